"""stepserve's models: architectures as pure step functions, loaders (GGUF, model
directories), the tokenizer and chat template, the static KV cache and the sampler.

Nothing here knows the server. CPU BLAS selection is an explicit call: :func:`models.blas.load_cpu_blas`.
"""
