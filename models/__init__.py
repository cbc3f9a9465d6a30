"""stepserve's models: architectures as pure step functions (``llama.py``, reused by ``qwen2.py``
and ``qwen3.py``; the linear and embedding layers in ``layers.py``), loaders (GGUF, model
directories), the refusal of configurations that ask for math not implemented
(``config_check.py``), the tokenizer and chat template, the static KV cache and the sampler.

Nothing here knows the server. CPU BLAS selection is an explicit call: :func:`models.blas.load_cpu_blas`.
"""
