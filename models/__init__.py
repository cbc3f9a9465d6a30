"""stepserve's models: architectures as pure step functions (``llama.py`` and its runners, reused
by ``qwen2.py``, ``qwen3.py``, ``gemma3_text.py`` and ``qwen3_moe.py``; ``architectures.py`` maps
``model_type`` to them; RoPE variants in ``rope.py``, attention and sliding-window rings in
``attention.py``, the linear and embedding layers in ``layers.py``), loaders (GGUF files in
``gguf/``, model directories in ``hf.py``, a pipeline stage's share in ``stage_loader.py``; the
default model in ``default.py``), the refusal of configurations that ask for math not implemented
(``config_check.py``), the tokenizer and chat template, the static KV cache and the sampler.

Nothing here knows the server. CPU BLAS selection is an explicit call: :func:`models.blas.load_cpu_blas`.
"""
