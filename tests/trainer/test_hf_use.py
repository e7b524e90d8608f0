"""A Hugging Face directory used without converting it: `--init-from` reads its tensors straight onto the
run's mesh (experts over `expert`), and refuses a run config of another model naming the key. A fine-tune
from it is a complete model: it trains on the data the user names (never synthetic tokens unasked), and its
`sample`, chat template and export are the model's own (tokenizer, special tokens, context)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from hf_models import (
    VOCAB,
    hf_model,
    one_torch_thread,  # noqa: F401 - autouse: torch on one thread here
    tokenizer_json,
)

from trainer import stacks

pytest.importorskip("torch")

# A chat template of the model's own, in its words (the word-level tokenizer's), unlike the server's default.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}w3 {{ m['role'] }} {{ m['content'] }} {{ eos_token }} {% endfor %}"
            "{% if add_generation_prompt %}w4{% endif %}")
# Words the model's tokenizer reads as one token in transformers too: transformers matches the special tokens
# (bos w1, eos w2) inside words, so that it reads w17 as w1 and an unknown 7, where `tokenizers` reads w17.
WORDS = [w for w in range(3, VOCAB) if not str(w).startswith(("1", "2"))]
SPECIAL = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w1", "eos_token": "w2",
           "chat_template": TEMPLATE}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A tiny Qwen2-MoE (biases, shared expert, a dense layer; 1,024 positions) saved by transformers with its
    tokenizer, special tokens and chat template, and its import."""
    from trainer.hf.convert import import_checkpoint

    tmp = tmp_path_factory.mktemp("hf-use")
    hf_model("qwen2_moe-sparse-step", seed=7, bos_token_id=1, eos_token_id=2).save_pretrained(tmp / "hub")
    tokenizer_json(tmp / "hub" / "tokenizer.json", VOCAB)
    (tmp / "hub" / "tokenizer_config.json").write_text(json.dumps(SPECIAL))
    import_checkpoint(str(tmp / "hub"), str(tmp / "imported"))
    return tmp


@pytest.fixture(scope="module")
def tuned(hub):
    """As a user fine-tunes an import: text prepared with the import's tokenizer (no --eod-token: the model's
    eos), 20 steps from the Hub directory on data=2,expert=4 with the data flags, then `hf export`."""
    from trainer.cli import train_command
    from trainer.hf.cli import hf_group
    from trainer.prepare import prepare_command

    rng = np.random.default_rng(3)  # counting from a random word: something to learn
    lines = [" ".join(f"w{a + i}" for i in range(24)) for a in rng.integers(5, 100, 300)]
    (hub / "docs.txt").write_text("\n".join(lines) + "\n")
    prepared = CliRunner().invoke(prepare_command, [str(hub / "docs.txt"), "--lines", "-o", str(hub / "ds"), "--quiet",
                                                    "--tokenizer", str(hub / "imported" / "hf" / "tokenizer.json")])
    assert prepared.exit_code == 0, prepared.output
    run = hub / "tuned"
    trained = CliRunner().invoke(train_command, [
        "--config", str(hub / "imported" / "config.json"), "--devices", "8", "--mesh", "data=2,expert=4", "--steps",
        "20", "--output-dir", str(run), "--init-from", str(hub / "hub"), "--set", "optim.lr=0.01", "--set",
        "data.source=records", "--set", f"data.path={hub / 'ds'}", "--set", "data.seq_len=32", "--metrics",
        str(hub / "m.jsonl")])
    assert trained.exit_code == 0, trained.output
    exported = CliRunner().invoke(hf_group, ["export", "--checkpoint", str(run), "-o", str(hub / "exported")])
    assert exported.exit_code == 0, exported.output
    rows = [json.loads(line) for line in (hub / "m.jsonl").read_text().splitlines()]
    return SimpleNamespace(run=run, exported=hub / "exported", rows=rows, output=trained.output + exported.output)


def test_init_from_a_hub_directory_reads_its_parameters_onto_the_mesh(hub):
    import jax

    from trainer import init_from, sharding
    from trainer.hf.families import load_trainer_config
    from trainer.hf.orbax_io import open_run
    from trainer.step import build_trainer

    cfg = load_trainer_config(str(hub / "imported" / "config.json"))
    trainer = build_trainer(cfg, sharding.make_mesh({"data": 2, "expert": 4}, jax.devices()[:8]), 10)
    state, source = init_from.initial_state(trainer, str(hub / "hub"))
    run = open_run(str(hub / "imported"), None)
    imported = run.read(set(run.shapes))
    assert sorted(state["params"]) == sorted(imported)
    for name, value in state["params"].items():
        assert value.sharding == trainer.state_shardings["params"][name], name
        assert np.asarray(value).tobytes() == imported[name].tobytes(), name
    w_in = stacks.locate(cfg.model, "blocks.1.ffn.w_in")[0]  # layer 1's, with the others of its stack
    assert state["params"][w_in].sharding.spec[1] == "expert"
    assert int(state["step"]) == 0
    assert source.as_dict()["path"] == str(hub / "hub") and source.fingerprint.startswith("hf:sha256:")


def test_init_from_a_hub_directory_refuses_a_config_of_another_model(hub):
    from trainer.cli import train_command

    config = str(hub / "imported" / "config.json")
    result = CliRunner().invoke(train_command, ["--config", config, "--devices", "1", "--steps", "1",
                                                "--set", "model.rope_theta=500000", "--set", "data.source=synthetic",
                                                "--init-from", str(hub / "hub")])
    assert result.exit_code == 2, result.output
    assert "model.rope_theta is 500000.0 in this run's config, 10000.0 in" in result.output
    assert "Traceback" not in result.output
    assert json.loads((hub / "imported" / "config.json").read_text())["model"]["rope_theta"] == 10000.0


def test_an_import_names_no_data_and_a_fine_tune_without_data_flags_is_refused_naming_them(hub, tmp_path):
    """The import's config.json has no data to train on (data.source none) and the model's context (1,024
    positions, or less where asked); `train` from it without data flags exits 2 naming them, training nothing."""
    from trainer.cli import train_command
    from trainer.hf.convert import import_checkpoint

    data = json.loads((hub / "imported" / "config.json").read_text())["data"]
    assert data["source"] == "none" and data["seq_len"] == 1024
    assert import_checkpoint(str(hub / "hub"), str(tmp_path / "short"), seq_len=256)["seq_len"] == 256
    assert json.loads((tmp_path / "short" / "config.json").read_text())["data"]["seq_len"] == 256
    result = CliRunner().invoke(train_command, ["--config", str(hub / "imported" / "config.json"), "--devices", "1",
                                                "--steps", "1", "--init-from", str(hub / "hub")])
    assert result.exit_code == 2, result.output
    assert "--set data.source=records --set data.path=DIR" in result.output
    assert "--set data.source=synthetic" in result.output and "Traceback" not in result.output


def test_a_fine_tune_takes_the_side_files_of_an_import_or_a_hub_directory(hub, tmp_path):
    """What --init-from named decides the side files a fine-tune takes: a Hub directory's own, an import's (or
    a fine-tune's) hf/; a run with none gives none."""
    from trainer import sidefiles

    assert sidefiles.of_source(str(hub / "hub")) == str(hub / "hub")
    assert sidefiles.of_source(str(hub / "imported")) == str(hub / "imported" / "hf")
    assert sidefiles.of_source(str(hub / "imported" / "checkpoints")) == str(hub / "imported" / "hf")
    (tmp_path / "scratch" / "checkpoints").mkdir(parents=True)
    assert sidefiles.of_source(str(tmp_path / "scratch")) is None
    (tmp_path / "again").mkdir()
    carried = sidefiles.carry(str(hub / "imported"), str(tmp_path / "again"))
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(carried)
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["hf"]  # nothing half-made beside it
    assert (tmp_path / "again" / "hf" / "tokenizer_config.json").read_bytes() == \
        (hub / "hub" / "tokenizer_config.json").read_bytes()


@pytest.mark.compile_bound
def test_sample_reads_a_fine_tuned_import_with_its_own_tokenizer_as_transformers_reads_its_export(tuned):
    """`sample` on the fine-tune: the prompt's words through the model's tokenizer.json, kept whole up to the
    model's context (an import's data.seq_len was 64, and 100 tokens were cut to their last 64), greedy tokens
    as transformers generates them from the export, decoded by the same tokenizer."""
    import torch
    import transformers

    from trainer.sample import sample_command

    tokenizer = transformers.AutoTokenizer.from_pretrained(tuned.exported)
    prompt = " ".join(f"w{WORDS[(i * 37) % len(WORDS)]}" for i in range(100))
    result = CliRunner().invoke(sample_command, ["--checkpoint", str(tuned.run), "--prompt", prompt,
                                                 "--tokens", "12", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert "exceed the model's context" not in result.output
    model = transformers.AutoModelForCausalLM.from_pretrained(tuned.exported, attn_implementation="eager").eval()
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert len(ids) == 100  # past the 64 positions an import used to sample within
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                             do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert result.stdout.splitlines()[0] == tokenizer.decode(out[0, len(ids):].tolist())


@pytest.mark.compile_bound
def test_fine_tune_on_eight_devices_then_export_serves_and_loads_as_transformers_computes(hub, tuned):
    """Import's config, --init-from the Hub directory, 20 steps on prepared text on data=2,expert=4 (one compiled
    step), export: the loss falls; transformers loads the export, with the model's tokenizer, chat template,
    special tokens and context, its logits the trainer's within 1e-4; the server would render chat with the
    model's template; and the run's checkpoint serves on the same 8 devices with the experts over expert=4
    (test_hf_oracle.py decodes every family there)."""
    import jax
    import torch
    import transformers
    from flax import nnx
    from hf_models import trainer_model

    from trainer import sharding
    from trainer.hf.families import load_trainer_config
    from trainer.outputs import RunDirectory
    from trainer.serve.chat import hub_chat_template, render
    from trainer.serve.weights import build_serving_model, restore_weights

    run = tuned.run
    assert "synthetic" not in tuned.output and "no tokenizer" not in tuned.output
    assert json.loads((run / "config.json").read_text())["data"]["source"] == "records"
    first, last = np.mean([r["loss"] for r in tuned.rows[:3]]), np.mean([r["loss"] for r in tuned.rows[-3:]])
    assert [r["step"] for r in tuned.rows] == list(range(1, 21)) and last < first - 0.5, (first, last)
    manifest = json.loads((hub / "ds" / "manifest.json").read_text())
    assert (manifest["eod_token"], manifest["eod_id"]) == ("w2", 2)  # the model's eos, with no --eod-token
    tokenizer = transformers.AutoTokenizer.from_pretrained(tuned.exported)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token) == ("w2", 2, "w1")
    assert tokenizer.chat_template == TEMPLATE
    config = transformers.AutoConfig.from_pretrained(tuned.exported)
    assert (config.max_position_embeddings, config.eos_token_id, config.bos_token_id) == (1024, 2, 1)
    assert transformers.GenerationConfig.from_pretrained(tuned.exported).eos_token_id == 2
    chat = [{"role": "user", "content": "w9 w10"}]
    served_chat = render(hub_chat_template(RunDirectory.at(str(run)).hub),
                         [SimpleNamespace(**m) for m in chat])
    assert served_chat == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tuned.exported, attn_implementation="eager",
                                                               experts_implementation="eager").eval()
    tokens = np.random.default_rng(8).integers(0, VOCAB, (8, 16))
    with torch.no_grad():
        logits = theirs(torch.tensor(tokens)).logits.numpy()
    ours, values = trainer_model(str(run))
    _, before = trainer_model(str(hub / "imported"))
    cfg = load_trainer_config(str(run / "config.json"))
    w_in = stacks.locate(cfg.model, "blocks.1.ffn.w_in")[0]  # layer 1's, with the others of its stack
    assert not np.array_equal(values[w_in], before[w_in])  # it did train
    graphdef, state = nnx.split(ours)
    got = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, train=False)[0])(state, tokens)  # one program, not one an op
    assert np.abs(np.asarray(got) - logits).max() <= 1e-4
    served = build_serving_model(cfg, sharding.make_mesh({"data": 2, "expert": 4}, jax.devices()[:8]))
    weights, _ = restore_weights(served, str(run / "checkpoints"))
    assert weights["params"][w_in].sharding.spec[1] == "expert"
    assert all(np.array_equal(np.asarray(weights["params"][n]), values[n]) for n in values)



def test_import_makes_the_directory_of_its_output_and_a_failed_one_leaves_none(hub, tmp_path):
    """`hf import -o runs/x` failed until runs/ existed; now runs/ is made, and removed again with the rest when
    the import fails (here the failure is raised inside the block that makes them)."""
    from trainer.hf.cli import main
    from trainer.hf.convert import made_parents
    from trainer.hf.errors import HFError

    main(["import", str(hub / "hub"), "-o", str(tmp_path / "runs" / "deep" / "x")])
    assert (tmp_path / "runs" / "deep" / "x" / "checkpoints").is_dir()
    with pytest.raises(HFError), made_parents(str(tmp_path / "other" / "runs" / "x")) as parent:
        assert parent == str(tmp_path / "other" / "runs")
        raise HFError("a bad tensor")
    assert not (tmp_path / "other").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(HFError, match=f"-o {tmp_path / 'file' / 'x'}: cannot make its directory"), made_parents(
            str(tmp_path / "file" / "x")):
        pass


def test_serve_takes_a_hugging_face_directory_through_an_import_it_caches(hub, tmp_path, monkeypatch):
    """`serve --checkpoint HF_DIR` exited 2, "holds no checkpoint": now the directory is imported once into the
    cache ($MOE_TPU_CACHE) and served from there, with its tokenizer and chat template (here the server stops
    at its --mesh, past the import and the chat template); a second start reads the cached import, the same
    parameters."""
    import os
    import shutil
    import socket

    from trainer.hf.orbax_io import open_run
    from trainer.run_loader import find_run, load_run_config
    from trainer.serve.chat import hub_chat_template
    from trainer.serve.cli import serve_command

    monkeypatch.setenv("MOE_TPU_CACHE", str(tmp_path / "cache"))
    model = shutil.copytree(hub / "hub", tmp_path / "model")
    (model / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(serve_command, ["--checkpoint", str(model), "--port", str(port),
                                                "--mesh", "data=1,expert=3"])  # refused past the import, cheaply
    assert result.exit_code == 2 and "--mesh data=1,expert=3" in result.output, result.output
    assert f"{model} is a Hugging Face checkpoint: importing it into {tmp_path / 'cache' / 'hf'}" in result.output
    seen = []
    run = find_run(str(model), progress=seen.append)
    assert seen == [] and run.path.startswith(str(tmp_path / "cache" / "hf"))  # the cached import, as it was
    assert load_run_config(run.config) == load_run_config(str(hub / "imported" / "config.json"))
    assert hub_chat_template(run.hub) is not None and os.path.isfile(os.path.join(run.hub, "tokenizer.json"))
    ours, theirs = open_run(run.path, None), open_run(str(hub / "imported"), None)
    assert all(np.array_equal(a, theirs.read({n})[n]) for n, a in ours.read(set(ours.shapes)).items())


@pytest.mark.compile_bound
def test_lm_eval_scores_the_served_fine_tune_as_transformers_scores_its_export(tuned, tmp_path, monkeypatch):
    """lm-evaluation-harness two ways on one multiple-choice task: its `hf` model on the fine-tune's export (what a
    user runs with `lm_eval --model hf`), and its `local-completions` model on the fine-tuned run served by the
    engine (`eval --checkpoint`): the same log-likelihood for every choice, within 1e-3."""
    import lm_eval

    from tests.lm_eval_tasks import MULTIPLE_CHOICE
    from trainer.serve.evaluate import task_manager, through_engine

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(11)
    rows = [{"question": " ".join(f"w{a + i}" for i in range(6)), "answer": 0,
             "choices": [f" w{c}" for c in rng.choice(WORDS, 3, replace=False)]} for a in rng.integers(30, 94, 8)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mc.yaml").write_text(MULTIPLE_CHOICE.format(name="hf_mc", data=tmp_path / "mc.jsonl"))
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(tuned.exported), "dtype": "float32", "device": "cpu"},
        tasks=["hf_mc"], task_manager=task_manager(["hf_mc"], str(tmp_path)), log_samples=True,
        batch_size=4)["samples"]["hf_mc"]
    # What `eval --checkpoint` runs, called as the command calls it: lm-eval, run inside click's CliRunner, would
    # log to the runner's stderr after the runner closed it.
    served = through_engine(str(tuned.run), None, 64, ["hf_mc"], task_manager(["hf_mc"], str(tmp_path)), limit=None,
                            batch_size=8, num_fewshot=None)["samples"]["hf_mc"]

    def loglikelihoods(samples):
        return {s["doc_id"]: [float(resp[0][0]) for resp in s["resps"]] for s in samples}

    ours, reference = loglikelihoods(served), loglikelihoods(theirs)
    assert sorted(ours) == sorted(reference) == list(range(len(rows)))
    for doc, values in reference.items():
        np.testing.assert_allclose(ours[doc], values, atol=1e-3, rtol=0, err_msg=f"document {doc}")
