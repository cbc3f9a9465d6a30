"""GGUF files (llama.cpp's format, ggml/docs/gguf.md): their layout checked before MLX parses
them (``header.py``), chosen tensors read alone for a pipeline stage (``tensors.py``), tensor
types MLX cannot read decoded by llama.cpp's ``gguf`` package (``quants.py``), hyper-parameters
and the parameter tree (``reader.py``, with Gemma 3's in ``gemma3.py``), the tokenizer rebuilt
from the metadata (``vocab.py``), and ``stepserve convert`` to an mlx-community directory
(``convert.py``).

The optional dependencies of ``pip install 'stepserve[gguf]'`` (``gguf`` for K-quants and Q5_0,
transformers for a SentencePiece vocabulary such as Gemma 3's) are imported here and nowhere else.
"""
