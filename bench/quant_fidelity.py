"""Weight-only quantization on CPU: fidelity against HF transformers fp32, and decode speed.

    .venv/bin/python bench/quant_fidelity.py [--modes none,int8,int4] [--json out.json]

The embedded default model (SmolLM2-135M, Q4_1 GGUF) loaded by kvserve in fp32 with each
--quantization mode, against transformers' fp32 load of the same file:
- greedy agreement on the parity prompts (kvserve/tools/parity.py, as tests/model/test_parity_hf.py), 32 new tokens
  each (kvserve's bare static loop, one prompt at a time): tokens equal to the reference
  (up to its EOS), and the first position where they differ;
- logit error on one prompt's prefill: max |Δ| over all positions and vocabulary, and the
  share of positions whose top token is the reference's;
- decode tokens/s of the bare static loop at 1 and 8 streams (128-token prompts, 64 new).
The model runs with the native CPU ops as the runner hands them over (`use_row_ops`: on a
CPU with AVX-512 VNNI int4 takes the native 4-bit kernel on 8-bit activations);
`--torch-ops` keeps torch's (int4 then is torch's kernel on bfloat16 activations).
Prints the CPU's flags beside the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from e2e_throughput import cpu_flags

from kvserve.kernels import native
from kvserve.model.files import resolve_model
from kvserve.model.weights import load_model
from kvserve.tools.parity import PARITY_NEW_TOKENS as NEW_TOKENS
from kvserve.tools.parity import PARITY_PROMPTS as PROMPTS
from kvserve.tools.staticloop import static_generate


def _reference(path: Path, prompts: list[list[int]], eos: set[int]) -> tuple[list[list[int]], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False)
            outs.append(out[0, len(ids):].tolist())
        logits = hf(torch.tensor([prompts[2]])).logits[0].float()
    return outs, logits


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, through the model's dense-attention path."""
    t = torch.tensor(ids)
    pos = torch.arange(len(ids))

    def attend(layer, q, k, v):
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(0, 1)

    return model.forward_tokens(t, pos, attend, torch.arange(len(ids)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="none,int8,int4")
    p.add_argument("--json")
    p.add_argument("--torch-ops", action="store_true", help="torch's ops, not the native ones the runner uses")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    path = resolve_model(None)
    results: dict = {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "modes": {},
                     "ops": "torch" if args.torch_ops else
                     f"native (4-bit kernel {'on' if native.int4_available() else 'not built here'})"}
    ref_tokens = ref_logits = None
    for mode in args.modes.split(","):
        loaded = load_model(None, dtype=torch.float32, device="cpu", quantization=mode)
        model, eos = loaded.model, set(loaded.eos_token_ids)
        if not args.torch_ops:
            model.use_row_ops(native)
        prompts = [loaded.tokenizer(text).input_ids for text in PROMPTS]
        if ref_tokens is None:
            ref_tokens, ref_logits = _reference(path, prompts, eos)
        equal = compared = 0
        first_diffs = []
        for ids, want in zip(prompts, ref_tokens, strict=True):
            got = static_generate(model, torch.tensor([ids]), NEW_TOKENS).tokens[0].tolist()[: len(want)]
            equal += sum(a == b for a, b in zip(got, want, strict=True))
            compared += len(want)
            first_diffs.append(next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None))
        with torch.inference_mode():
            logits = _prefill_logits(model, prompts[2])
        err = (logits - ref_logits).abs().max().item()
        top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        speed = {}
        for streams in (1, 8):
            batch = torch.randint(1000, 40000, (streams, 128))
            static_generate(model, batch[:, :16], 4)  # warm
            speed[streams] = static_generate(model, batch, 64).decode_tokens_per_s
        same = sum(d is None for d in first_diffs)
        results["modes"][mode] = {"token_match": equal / compared, "prompts_identical": same,
                                  "first_divergence": first_diffs, "max_abs_logit_error": err,
                                  "top1_agreement": top1, "decode_tokens_per_s": speed}
        print(f"{mode:>5}: greedy tokens equal to HF fp32 {equal}/{compared} ({equal / compared:.3f}), "
              f"{same}/{len(prompts)} prompts identical, first divergence {first_diffs}; prefill logits "
              f"max |err| {err:.4f}, top-1 agreement {top1:.3f}; decode {speed[1]:.1f} tok/s at 1 stream, "
              f"{speed[8]:.1f} at 8", flush=True)
        del loaded, model
    print(f"cpu flags: {results['cpu_flags']}  threads: {results['threads']}  ops: {results['ops']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
