"""The real Gemma 3 270M GGUF (Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors, which MLX's reader
refuses): its configuration as llama.cpp reads it, its SentencePiece tokenizer rebuilt by
transformers' GGUF conversion, Gemma's chat template (no system role) followed as written,
and clear messages when the optional packages are missing."""

from __future__ import annotations

import sys
from dataclasses import replace

import mlx.core as mx
import pytest

from models.errors import ModelLoadError
from models.gguf.header import read_gguf_header
from models.gguf.quants import MLX_READABLE_TYPES
from models.gguf.reader import args_from_metadata, read_gguf
from models.gguf.vocab import tokenizer_from_gguf
from models.tokenizer import TokenizerError
from service.api.tools import render_messages
from tests.support import gemma_gguf


@pytest.fixture(scope="module")
def header():
    return read_gguf_header(gemma_gguf())


@pytest.fixture(scope="module")
def tokenizer(header):
    return tokenizer_from_gguf(header.metadata, gemma_gguf())


def test_mlx_cannot_read_it_so_the_gguf_package_does(header):
    assert {t.ggml_type for t in header.tensors} - MLX_READABLE_TYPES  # Q4_K (12), Q5_0 (6), Q6_K (14)
    with pytest.raises(RuntimeError, match="gguf_tensor_to_f16 failed"):
        mx.load(str(gemma_gguf()), return_metadata=True)


def test_its_configuration_is_llama_cpps(header):
    tensors = {"token_embd.weight": mx.zeros((262144, 1))}  # only the vocabulary size is read from it
    args = args_from_metadata(header.metadata, tensors, gemma_gguf())
    assert (args.model_type, args.num_hidden_layers, args.hidden_size, args.head_dim) == ("gemma3_text", 18, 640, 256)
    assert args.windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))  # every 6th layer global
    assert (args.rope_theta, args.rope_local_base_freq, args.attention_scale) == (1e6, 1e4, 256**-0.5)
    assert args.tie_word_embeddings and args.rope_scaling is None


def test_the_tokenizer_is_gemmas(tokenizer):
    # ids checked against sentencepiece's own BPE on the file's pieces and scores (docs/ARCHITECTURE.md)
    assert tokenizer.encode("Hello world") == [2, 9259, 1902]  # BOS first (tokenizer.ggml.add_bos_token)
    assert tokenizer.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert tokenizer.encode("  two spaces\tand 12") == [2, 138, 13498, 9952, 255968, 624, 236743, 236770, 236778]
    assert tokenizer.encode("<bos>Hi") == tokenizer.encode("Hi")  # a template's own BOS is not doubled
    assert tokenizer.encode("<start_of_turn>user") == [2, 105, 2364]  # control tokens stay whole
    assert tokenizer.decode(tokenizer.encode("héllo wörld 日本語 🤗")) == "héllo wörld 日本語 🤗"
    assert {1, 106} <= tokenizer.stop_token_ids  # <eos> and <end_of_turn>
    assert tokenizer.chat_template is None  # the base model: raw completions only


def test_a_missing_gguf_package_is_named_with_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ModelLoadError, match=r"pip install 'stepserve\[gguf\]'"):
        read_gguf(gemma_gguf())


def test_a_missing_transformers_is_named_with_its_install_command(monkeypatch, header):
    for name in ("transformers.integrations.gguf.gguf_tokenizer_mapping", "transformers.integrations.ggml"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ModelLoadError, match=r"SentencePiece tokenizer needs pip install 'stepserve\[gguf\]'"):
        tokenizer_from_gguf(header.metadata, gemma_gguf())


# Gemma 3 instruction-tuned checkpoints' chat template (tokenizer_config.json): no system role;
# a system message is folded into the first user turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def test_a_template_without_a_system_role_is_followed(tokenizer):
    chat = replace(tokenizer, chat_template=GEMMA3_TEMPLATE, _template=None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = render_messages(chat, messages)  # as the API renders them
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = chat.encode(text)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1  # the template's BOS, not a second one
    with pytest.raises(TokenizerError, match="roles must alternate"):
        render_messages(chat, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
