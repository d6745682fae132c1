"""The model: config, files (fetch + cache), GGUF and safetensors loading, the Llama-family
network (`llama`), and the torch-free tokenizer (`tokenizer`) the frontend uses."""
