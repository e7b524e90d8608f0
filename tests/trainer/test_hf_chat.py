"""An imported model's chat template (tokenizer_config.json) renders as transformers renders it, in jinja2's
sandbox; a conversation the template refuses is a 400 naming `messages`."""

import json
from types import SimpleNamespace

import pytest
from hf_models import VOCAB, tokenizer_json

transformers = pytest.importorskip("transformers")

from trainer.serve.chat import ChatTemplateError, hub_chat_template, render  # noqa: E402

# A ChatML-style template with a default system turn, the special tokens and a refusal, as Hub models ship them.
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [[{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]]


@pytest.fixture
def run(tmp_path):
    """A run directory as `hf import` leaves it: hf/tokenizer.json and hf/tokenizer_config.json."""
    (tmp_path / "hf").mkdir()
    tokenizer_json(tmp_path / "hf" / "tokenizer.json", VOCAB)
    config = {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}}
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def _messages(conversation):
    return [SimpleNamespace(**m) for m in conversation]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_the_template_renders_as_transformers_renders_it(run, conversation):
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(run / "hf" / "tokenizer.json"),
                                                     chat_template=TEMPLATE, bos_token="<s>", eos_token="</s>")
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert render(hub_chat_template(str(run / "hf")), _messages(conversation)) == expected


def test_a_refused_conversation_is_a_400_naming_messages(run):
    import asyncio

    from trainer.serve.protocol import APIError, ChatRequest
    from trainer.serve.routes import _chat_ids
    from trainer.serve.server import ServerState

    state = ServerState("m", encode=lambda text: [1], decode=lambda ids: "", max_waiting=1)
    state.chat_template = hub_chat_template(str(run / "hf"))
    body = ChatRequest(model="m", messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(APIError) as refused:
        asyncio.run(_chat_ids(state, body))
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert refused.value.message == "unknown role tool"


def test_the_template_runs_in_a_sandbox(run):
    config = json.loads((run / "hf" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (run / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="fails on these messages"):
        render(hub_chat_template(str(run / "hf")), _messages(CONVERSATIONS[0]))


def test_no_template_leaves_the_servers_own_format(tmp_path):
    assert hub_chat_template(str(tmp_path)) is None
    assert render({"message": "{role}: {content}\n", "generation": "assistant:"},
                  _messages(CONVERSATIONS[0])) == "user: hi\nassistant:"


def test_an_imported_model_stops_at_its_own_end_of_sequence_token(run):
    """The server stops where the model's generation_config.json (else its config.json) says a sequence ends,
    with the token's text from the model's tokenizer; a run with neither stops on its data's token only."""
    from trainer.config import load_config
    from trainer.outputs import RunDirectory
    from trainer.run_loader import Codec
    from trainer.serve.startup import end_of_document

    cfg = load_config("tiny", [f"model.vocab_size={VOCAB}"])
    codec = Codec(cfg, str(run / "hf" / "tokenizer.json"))
    imported = RunDirectory.at(str(run))
    assert end_of_document(cfg, codec, imported) == (None, None)  # synthetic data, no hub files
    (run / "hf" / "config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert end_of_document(cfg, codec, imported) == (3, codec.decode([3]))
    (run / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert end_of_document(cfg, codec, imported) == (2, codec.decode([2]))
