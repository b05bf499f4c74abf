"""Through the openai client: long passkey chats with a small device budget, and the pin extension."""
import random

import httpx
import openai
import pytest
from conftest import kvtier_server
from openai import OpenAI

from kvtier.bench.niah import recall_chat
from kvtier.models.tokenizer import Tokenizer

pytestmark = pytest.mark.integration

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_message(key: int, repeats: int) -> str:
    parts = [FILLER] * repeats
    parts.insert(repeats // 3, f"The pass key is {key}. Remember it. {key} is the pass key. ")
    return ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the pass key.\n" + "".join(parts) + "\nWhat is the pass key?")


def test_passkey_with_a_512_token_budget_and_pins(tmp_path):
    args = ["--kv-pool-tokens", "4096", "--max-model-len", "4096", "--kv-resident-tokens", "512", "--no-kv-disk"]
    key = random.Random(7).randint(10000, 99999)
    with kvtier_server(args, tmp_path / "server.log") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": passkey_message(key, 100)}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                               extra_body={"kvtier": {"pin": [[0, 30]]}})
        assert reply.usage.prompt_tokens > 2000          # four times the device budget
        assert str(key) in reply.choices[0].message.content

        with pytest.raises(openai.BadRequestError, match="no room for a scored block"):
            client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           extra_body={"kvtier": {"pin": [[0, 480]]}})
        with pytest.raises(openai.BadRequestError, match="pin"):
            client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           extra_body={"kvtier": {"pin": [[100, 50]]}})

        metrics = httpx.get(f"{url}/metrics").text
        assert "kvtier_kv_page_outs_total" in metrics and "kvtier_kv_reselect_seconds_total" in metrics
        page_outs = next(line for line in metrics.splitlines() if line.startswith("kvtier_kv_page_outs_total"))
        assert float(page_outs.split()[-1]) > 0


def test_a_4k_chat_recalls_its_pass_key_with_a_256_token_budget(tmp_path, bundled_tokenizer: Tokenizer):
    """The key is told halfway through a long conversation and asked for at the end, with no pin and no
    begun answer: the pager must bring the key's blocks back while the answer is decoded."""
    key = random.Random("chat-0.5").randint(10000, 99999)     # the NIAH chat probe's middle case
    messages = recall_chat(bundled_tokenizer, 4000, key, 0.5)
    args = ["--kv-pool-tokens", "1024", "--kv-resident-tokens", "256", "--no-kv-disk"]
    with kvtier_server(args, tmp_path / "server.log") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        assert reply.usage.prompt_tokens > 4000                   # sixteen times the device budget
        assert str(key) in reply.choices[0].message.content
        metrics = httpx.get(f"{url}/metrics").text
        most = next(line for line in metrics.splitlines() if line.startswith("kvtier_kv_max_resident_blocks"))
        assert float(most.split()[-1]) <= 256 // 16
