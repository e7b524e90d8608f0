"""lm-evaluation-harness against the engine (trainer.serve.evaluate): a local 20-item multiple-choice task and a
10-item generate-until task, through the shared small engine's server; every loglikelihood lm-eval records
equals the model's own full forward pass's (teacher-forced) within 1e-3, float32."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.lm_eval_tasks import MULTIPLE_CHOICE
from trainer.serve.evaluate import eval_command, harness, served, task_manager, write_results
from trainer.serve.server import ServerState

pytestmark = pytest.mark.compile_bound

GEN = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def tasks(tmp_path):
    rng = np.random.RandomState(5)
    words = ["cat", "dog", "sun", "tree", "blue", "red", "one", "two"]
    mc = [{"question": f"Q{i}: which is {words[i % 8]}?", "choices": [f" {w}" for w in rng.choice(words, 3, False)],
           "answer": int(rng.randint(3))} for i in range(20)]
    gen = [{"question": f"Say {words[i % 8]}:", "answer": words[i % 8]} for i in range(10)]
    for name, rows, template in (("mc", mc, MULTIPLE_CHOICE), ("gen", gen, GEN)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / f"{name}.yaml").write_text(template.format(name=f"tiny_{name}", data=data))
    return mc


def test_lm_eval_runs_local_tasks_against_the_engine_and_scores_as_the_forward_pass(served_state, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    state = served_state
    mc = tasks(tmp_path)
    engine = state.loop.engine
    with served(state) as url:
        names = ["tiny_mc", "tiny_gen"]
        results = harness(url, "tiny", engine.max_len, names, task_manager(names, str(tmp_path)), limit=None,
                          batch_size=4, num_fewshot=None)
    assert set(results["results"]) == {"tiny_mc", "tiny_gen"}
    assert 0 <= results["results"]["tiny_mc"]["acc,none"] <= 1
    assert len(results["samples"]["tiny_gen"]) == 10
    forward = jax.jit(lambda w, t: jax.nn.log_softmax(engine.model.module(w)(t, train=False)[0], axis=-1))
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == 20
    for sample in samples:
        doc = mc[sample["doc_id"]]
        assert len(sample["arguments"]) == len(doc["choices"])
        for (context, continuation), ((logprob, _),) in zip(sample["arguments"], sample["resps"], strict=True):
            assert context == doc["question"]  # the pair lm-eval scored, as it recorded it
            context, ids = list(context.encode()), list((context + continuation).encode())
            padded = jnp.asarray([ids + [0] * (48 - len(ids))], jnp.int32)
            expected = np.asarray(forward(engine.weights, padded)[0])
            want = sum(float(expected[i - 1, ids[i]]) for i in range(len(context), len(ids)))
            assert float(logprob) == pytest.approx(want, abs=1e-3)
    write_results(results, str(tmp_path / "run" / "eval" / "results.json"))
    assert json.loads((tmp_path / "run" / "eval" / "results.json").read_text())["results"]["tiny_mc"]


@pytest.fixture()
def served_state(served):
    _, state = served
    fresh = ServerState("tiny", encode=state.encode, decode=state.decode, max_waiting=8)
    fresh.loop = state.loop
    return fresh


def test_bad_flags_exit_2_before_anything_is_loaded(tmp_path):
    from click.testing import CliRunner

    for args, needle in ((["--tasks", " , "], "name at least one task"),
                         (["--tasks", "x", "--limit", "some"], "--limit 'some'"),
                         (["--tasks", "x", "--limit", "0"], "must be above 0")):
        result = CliRunner().invoke(eval_command, ["--checkpoint", str(tmp_path / "none"), *args])
        assert result.exit_code == 2 and needle in result.output, result.output
