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
    assert render(hub_chat_template(str(run)), _messages(conversation)) == expected


def test_a_refused_conversation_is_a_400_naming_messages(run):
    from trainer.serve.server import APIError, ServerState, _chat_text

    state = ServerState("m", encode=lambda text: [1], decode=lambda ids: "", max_waiting=1)
    state.chat_template = hub_chat_template(str(run))
    with pytest.raises(APIError) as refused:
        _chat_text(state, _messages([{"role": "tool", "content": "x"}]))
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert refused.value.message == "unknown role tool"


def test_the_template_runs_in_a_sandbox(run):
    config = json.loads((run / "hf" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (run / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="fails on these messages"):
        render(hub_chat_template(str(run)), _messages(CONVERSATIONS[0]))


def test_no_template_leaves_the_servers_own_format(tmp_path):
    assert hub_chat_template(str(tmp_path)) is None
    assert render({"message": "{role}: {content}\n", "generation": "assistant:"},
                  _messages(CONVERSATIONS[0])) == "user: hi\nassistant:"
