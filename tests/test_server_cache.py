"""Through the openai client: cached_tokens grow turn after turn, and survive a server restart."""
import pytest
from conftest import kvtier_server
from openai import OpenAI

pytestmark = pytest.mark.integration

CONTEXT = ("I am planning a long trip through France next spring with two friends who love art, food and "
           "old buildings. We will arrive by train from Brussels, stay about ten days, and we would like to "
           "avoid the busiest tourist traps when we can. ")
TURNS = [CONTEXT + "Tell me about the history of Paris in a few sentences.",
         CONTEXT + "And what about its famous museums? Please name several of them.",
         CONTEXT + "Which one should we visit first, and why? Keep it short."]


def chat(url, messages):
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)


def test_cached_tokens_grow_and_survive_restart(tmp_path):
    # float32 weights: warm equals cold to the token. With quantized weights decode rows quantize their activations,
    # which can turn a last prompt token's rounding (computed in another chunk) into a different near-tie choice
    args = ["--kv-pool-tokens", "8192", "--max-model-len", "2048", "--kv-disk-dir", str(tmp_path / "kv"),
            "--quantize", "none"]
    messages, cached = [], []
    with kvtier_server(args, tmp_path / "first.log") as url:
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            reply = chat(url, messages)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        last_prompt, last_answer = messages[:-1], messages[-1]["content"]
    assert cached[0] == 0 and 0 < cached[1] < cached[2]
    assert cached[2] > reply.usage.prompt_tokens - 64 - 30     # all but the new message and the last block

    with kvtier_server(args, tmp_path / "second.log") as url:   # a restart: only the disk tier remains
        reply = chat(url, last_prompt)
    # the first server computed and saved this very prompt: all of it but the last token comes back, the part
    # after its last full block from the partial block it left
    assert reply.usage.prompt_tokens_details.cached_tokens == reply.usage.prompt_tokens - 1, diagnosis(tmp_path)
    assert reply.choices[0].message.content == last_answer        # warm equals cold
    assert "from disk" in (tmp_path / "second.log").read_text()


def diagnosis(tmp_path) -> str:
    """What the servers logged (but HTTP lines) and which partial blocks' entries the disk tier holds: this test
    failed once in a loaded suite (the partial block not found after the restart) and never alone."""
    logs = {}
    for name in ("first.log", "second.log"):
        lines = (tmp_path / name).read_text().splitlines()
        # kvtier's own lines, and the last ones (did the first server shut down, or was it killed?)
        logs[name] = [line for line in lines[:-4] if " kvtier" in line] + lines[-4:]
    partials = sorted(p.name for p in (tmp_path / "kv").rglob("*.kvp"))
    blocks = sorted(p.name for p in (tmp_path / "kv").rglob("*.kvb"))
    return f"logs: {logs}\npartial entries: {partials}\nblock files: {blocks}"
