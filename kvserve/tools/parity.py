"""The prompts kvserve's output is compared on against a reference (HF transformers in
tests/model/test_parity_hf.py; the quantized modes in bench/quant_fidelity.py)."""

PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three uses of copper:\n1.",
    "Explain why the sky is blue in one paragraph.",
    "12 + 30 =",
    "import numpy as np\n",
]
PARITY_NEW_TOKENS = 32
