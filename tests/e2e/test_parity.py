"""mlx-lm's generate gives the text a real `stepserve serve` serves for the same weights."""

import mlx.core as mx
import mlx_lm


def test_mlx_lm_generates_what_stepserve_serves_from_the_gguf(server, converted):
    """The session's default server (compile on, default settings): no server of its own, whose
    start-up and warm-up would add nothing this comparison needs."""
    reference, hf_tokenizer = mlx_lm.load(str(converted))
    reference.set_dtype(mx.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    expected = mlx_lm.generate(reference, hf_tokenizer, prompt=ids, max_tokens=24)
    with server.client() as client:
        served = client.post("/infer", json={"messages": messages, "max_tokens": 24}).json()
    assert "Paris" in served["text"]
    assert served["text"] == expected.strip() or served["text"] == expected.removesuffix("<|im_end|>")
