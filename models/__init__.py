"""stepserve models: GGUF loading, the Llama-family decoder, tokenizer, KV cache and sampler."""
