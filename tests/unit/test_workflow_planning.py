"""The workflow's planning as library code (pretrain_bench.workflow, pretrain_bench.config.validation): short config
errors naming the dotted key, finite numbers, run names Snakemake accepts, one GPU count from --resources gpu, the
matrix's cells above it left out, planning once per cell, and the job lines a failed run ends with."""
import copy
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pretrain_bench.config.schema import ConfigError, coerce_command_line_types, project_schema
from pretrain_bench.config.validation import check_name, validate_config
from pretrain_bench.train.settings import TrainSettings, resolve_gpus
from pretrain_bench.workflow.failures import closing_lines, failure_report, own_lines
from pretrain_bench.workflow.pipeline import Pipeline, PlanError, resource_number

ROOT = Path(__file__).resolve().parents[2]
MAX_ERROR_LINES = 15


def raw_config(**overlay) -> dict:
    """config.yaml with config/tiny-cpu.yaml merged in, before validation, and `overlay` merged in as blocks."""
    from snakemake.utils import update_config

    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    update_config(config, yaml.safe_load((ROOT / "config" / "tiny-cpu.yaml").read_text()))
    update_config(config, overlay)
    return config


def config_error(config: dict) -> str:
    coerce_command_line_types(config, project_schema())
    with pytest.raises(ConfigError) as caught:
        validate_config(config, project_schema())
    text = str(caught.value)
    assert len(text.splitlines()) <= MAX_ERROR_LINES, text
    assert "schema[" not in text and "Failed validating" not in text and "Traceback" not in text, text
    return text


@pytest.mark.parametrize("overlay, key, given, allowed", [
    ({"report": {"gpu_hour_price": 2.5}}, "report.gpu_hour_price", "2.5", "a mapping or null"),
    ({"report": {"gpu_hour_price": {"amount": -1, "currency": "USD"}}}, "report.gpu_hour_price.amount", "-1",
     "numbers >= 0"),
    ({"train": {"lr_schedule": "cosin"}}, "train.lr_schedule", "'cosin'", "did you mean 'cosine'?"),
    ({"train": {"micro_batch_size": "eight"}}, "train.micro_batch_size", "'eight'", "an integer"),
    ({"evaluate": {"generation": {"top_k": -3}}}, "evaluate.generation.top_k", "-3", "numbers >= 0"),
    ({"model": {"seq_len": 4}}, "model.seq_len", "4", "numbers >= 8"),
    ({"train": {"gpus": "autp"}}, "train.gpus", "'autp'", "did you mean 'auto'?"),
])
def test_a_wrong_value_is_named_by_its_dotted_key_with_what_is_allowed_and_the_description(overlay, key, given,
                                                                                          allowed):
    text = config_error(raw_config(**overlay))
    assert text.startswith(f"{key}: {given} is not allowed"), text
    assert allowed in text
    assert f"  {key}: " in text  # the description, headed by the key


def test_an_unknown_key_nested_or_not_gets_a_did_you_mean():
    text = config_error(raw_config(train={"lr_scheduel": "cosine"}))
    assert text.startswith("train.lr_scheduel: not a config key (given: 'cosine'); did you mean 'lr_schedule'?")
    config = raw_config()
    config["corpus"]["sources"][0]["urii"] = "x"
    assert "corpus.sources[0].urii: not a config key (given: 'x'); did you mean 'uri'?" in config_error(config)
    assert "did you mean" not in config_error(raw_config(evaluate={"zzzzzz": 1}))


def number_keys(schema: dict, config: dict, path=()):
    """(dotted path, parent mapping, key) of every key the schema types as a number (float), present in `config`."""
    for key, sub in (schema.get("properties") or {}).items():
        if not isinstance(config, dict) or key not in config:
            continue
        types = sub.get("type", [])
        types = [types] if isinstance(types, str) else types
        if "number" in types:
            yield ".".join((*path, key)), config, key
        if "object" in types:
            yield from number_keys(sub, config[key], (*path, key))


def test_every_float_key_refuses_nan_and_infinity_naming_the_key():
    validated = validate_config(coerce_command_line_types(raw_config(report={"gpu_hour_price": {
        "amount": 2.0, "currency": "USD"}}), project_schema()), project_schema())
    keys = [path for path, _, _ in number_keys(project_schema(), validated)]
    assert {"train.lr", "train.weight_decay", "train.grad_clip", "train.min_lr", "report.target_corpus_tokens",
            "report.gpu_hour_price.amount"} <= set(keys)
    for dotted in keys:
        for bad in (math.nan, math.inf, -math.inf):
            config = copy.deepcopy(validated)
            parent, key = next((p, k) for d, p, k in number_keys(project_schema(), config) if d == dotted)
            parent[key] = bad
            with pytest.raises(ConfigError, match=rf"^{dotted.replace('.', '[.]')}: {bad} is not a finite number"):
                validate_config(config, project_schema())
    # from the command line: --config 'train={"lr": ".nan"}' reaches the config as the string ".nan"
    assert config_error(raw_config(train={"lr": ".nan"})).startswith("train.lr: nan is not a finite number")
    assert config_error(raw_config(train={"adam_betas": [0.9, ".inf"]})).startswith("train.adam_betas[1]: inf")


def test_a_run_name_snakemake_would_read_as_recursion_is_refused_naming_name():
    check_name("run-000000000000000000")  # 18 repeats: accepted by Snakemake too
    with pytest.raises(ConfigError, match=r"^name 'run-0000000000000000000000' ends in '0' repeated 22 times"):
        check_name("run-0000000000000000000000")
    with pytest.raises(ConfigError, match=r"^name .* ends in 'ab' repeated 20 times"):
        check_name("x" + "ab" * 20)
    assert config_error(raw_config(name="run-" + "0" * 22)).startswith("name 'run-")


def test_gpus_auto_takes_the_gpu_resource_and_a_larger_number_is_refused_naming_both():
    assert resolve_gpus("auto", "cpu", 1, 2) == 2
    assert resolve_gpus("auto", "cuda", 2, 8) == 4  # divided over the nodes
    assert resolve_gpus("auto", "cpu", 1, None) == 1  # a CPU run without --resources gpu: one rank
    assert resolve_gpus(3, "cpu", 1, None) == 3 and resolve_gpus(3, "cpu", 1, 3) == 3
    with pytest.raises(ConfigError, match=r"train.gpus 3 but --resources gpu=2.*never|train.gpus 3 but --resources "
                                          r"gpu=2: the job would be capped"):
        resolve_gpus(3, "cpu", 1, 2)
    with pytest.raises(ConfigError, match=r"train.gpus 2 × train.nodes 2 = 4 GPUs but --resources gpu=3"):
        resolve_gpus(2, "cuda", 2, 3)
    with pytest.raises(ConfigError, match=r"--resources gpu=1 leaves no GPU per node for train.nodes 2"):
        resolve_gpus("auto", "cuda", 2, 1)
    assert TrainSettings(device="cpu").gpus == 1  # settings built in code: auto as without a resource
    assert resource_number(SimpleNamespace(value=3)) == 3 and resource_number(None) is None


@pytest.fixture
def in_tmp(tmp_path):
    """The working directory a Snakemake run would have: results/ relative to it, empty."""
    old = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(old)


def tiny_pipeline(gpu_resource, **overlay) -> Pipeline:
    return Pipeline(raw_config(**overlay), ROOT, gpu_resource=gpu_resource, cores=2)


def test_pipeline_plans_auto_ranks_from_the_resource_and_leaves_out_cells_above_it(in_tmp):
    pipeline = tiny_pipeline(2, train={"gpus": "auto"})
    assert pipeline.settings.train.gpus == 2 and pipeline.config["train"]["gpus"] == 2
    assert pipeline.main_plan_config.train.gpus == 2 and pipeline.main_plan_config.as_dict()["train"]["gpus"] == 2
    left_out = [e for e in pipeline.matrix["cells"] if e["gpus"] == 3 and e["comm_backend"] == "gloo"]
    assert left_out and all(e["status"] == "unsupported" and e["reason"] == "needs 3 GPUs, --resources gpu=2"
                            for e in left_out)
    assert all(entry["gpus"] <= 2 for entry in pipeline.bench_cells.values())
    with pytest.raises(PlanError, match=r"does not run: needs 3 GPUs, --resources gpu=2"):
        pipeline.bench_cell(left_out[0]["cell"])
    with pytest.raises(PlanError, match=r"^invalid configuration: train.gpus 3 but --resources gpu=2"):
        tiny_pipeline(2)  # the tiny config's explicit 3


def test_a_cell_is_planned_once_however_many_repeats_ask(in_tmp, monkeypatch):
    import pretrain_bench.workflow.pipeline as pipeline_module

    pipeline = tiny_pipeline(3, benchmark={"repeats": 2})
    calls = []
    real = pipeline_module.cell_settings
    monkeypatch.setattr(pipeline_module, "cell_settings", lambda *a: calls.append(a) or real(*a))
    cells = sorted(pipeline.bench_cells)
    for _repeat in range(3):
        for cell in cells:
            pipeline.cell_plan_config(cell)
    assert len(calls) == len(cells)
    config = pipeline.cell_plan_config(cells[0])
    assert config.train.gpus == pipeline.bench_cells[cells[0]]["gpus"] and config.cell
    marked = []
    first = pipeline.previous_round("run", 2, lambda path: marked.append(path) or f"ancient:{path}")
    again = pipeline.previous_round("run", 2, lambda path: pytest.fail("the round is worked out once"))
    assert first == again == [f"ancient:results/run/bench/{cell}/rep1/summary.json" for cell in cells]
    assert pipeline.previous_round("run", 1, str) == []
    assert pipeline.bench_summaries("run")[:2] == [f"results/run/bench/{cells[0]}/rep1/summary.json",
                                                   f"results/run/bench/{cells[0]}/rep2/summary.json"]


FAILED_LOG = """\
=== pretrain-bench launcher: attempt started at 2026-12-04 16:39:28 +0000, pid 13412 on vm, plan p.json ===
launch: /usr/bin/python -m pretrain_bench.train.forked_ranks --nproc-per-node=1 --standalone pretrain.py
[2026-12-04 16:39:29,001] [INFO] [real_accelerator.py:254:get_accelerator] Setting ds_accelerator to cpu
/x/torch/distributed.py:12: UserWarning: something of torch's
  warnings.warn(
start-up: {"what": "first training step", "rank": 0}
step 40/160 loss 5.9434 lr 1.36e-02 4,277 tokens/s step 0.359s ETA 56s
2026-12-04 16:39:30,120 INFO pretrain_bench.train.checkpoints.checkpointer: checkpoint step 40 saved in results/r/state
2026-12-04 16:39:30,121 INFO deepspeed: not ours
Traceback (most recent call last):
  File "/x/pretrain.py", line 12, in <module>
    main()
    ^^^^^^
NameError: name 'resolve_zero_stage' is not defined
=== attempt ended at 2026-12-04 16:39:39 +0000: exit status 1 ===
"""


def test_a_failed_job_ends_the_terminal_with_its_own_lines_and_the_cause_without_a_traceback(tmp_path):
    bar = "Loading checkpoint shards: 100%|██████████| 1/1 [00:00<00:00, 12.34it/s]"
    assert own_lines(bar + "\n" + FAILED_LOG) == own_lines(FAILED_LOG), "a library's progress bar is not ours"
    assert own_lines("evaluated 100% of the held-out tokens\n") == ["evaluated 100% of the held-out tokens"]
    lines = own_lines(FAILED_LOG)
    assert lines == [
        "=== pretrain-bench launcher: attempt started at 2026-12-04 16:39:28 +0000, pid 13412 on vm, plan p.json ===",
        "step 40/160 loss 5.9434 lr 1.36e-02 4,277 tokens/s step 0.359s ETA 56s",
        "checkpoint step 40 saved in results/r/state",
        "NameError: name 'resolve_zero_stage' is not defined",
        "=== attempt ended at 2026-12-04 16:39:39 +0000: exit status 1 ===",
    ]
    log = tmp_path / "pretrain.log"
    log.write_text(FAILED_LOG)
    job = SimpleNamespace(rule=SimpleNamespace(name="pretrain"), log=[str(log)])
    quiet = SimpleNamespace(rule=SimpleNamespace(name="report"), log=[str(tmp_path / "never-written.log")])
    text = failure_report([job, quiet])
    assert text.splitlines()[1] == f"rule pretrain ({log}):"
    assert text.splitlines()[-2:] == ["  NameError: name 'resolve_zero_stage' is not defined",
                                      "  === attempt ended at 2026-12-04 16:39:39 +0000: exit status 1 ==="]
    assert "Traceback" not in text and "File " not in text and "report" not in text
    assert failure_report([quiet]) is None


STOPPED_LOG = """\
step 2/40 loss 7.4373 lr 4.50e-03 4,062 tokens/s step 0.252s ETA 15s
2026-12-04 16:39:30,120 INFO pretrain_bench.train.launcher: SIGINT received: asking the ranks to save the step in \
flight and stop
error (rank 0): SIGINT received: checkpoint step 3 saved in results/r/state/checkpoints; exiting non-zero so the job \
is retried (rerun the same command to resume)
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 12, in <module>
torch.distributed.elastic.multiprocessing.api.SignalException: Process 7920 got signal: 15
=== attempt ended at 2026-12-04 16:39:39 +0000: exit status 1 ===
"""


def test_a_stopped_job_ends_the_terminal_with_the_saved_step_and_the_command_that_continues(tmp_path):
    assert "SignalException" not in "\n".join(own_lines(STOPPED_LOG)), "torchrun's report of the stop passed on"
    unasked = "Traceback (most recent call last):\n  File x\n" + STOPPED_LOG.splitlines()[-2] + "\n"
    assert own_lines(unasked) == [STOPPED_LOG.splitlines()[-2]], "a signal the launcher did not pass on is a cause"
    log = tmp_path / "pretrain.log"
    log.write_text(STOPPED_LOG)
    job = SimpleNamespace(rule=SimpleNamespace(name="pretrain"), log=[str(log)])
    argv = ["/venv/lib/python3.11/site-packages/snakemake/__main__.py", "--cores", "2", "--configfile", "my run.yaml"]
    assert closing_lines([job], argv).splitlines() == [
        "rule pretrain: checkpoint step 3 saved in results/r/state/checkpoints",
        "To continue from it, run the same command again:",
        "  snakemake --cores 2 --configfile 'my run.yaml'",
    ]
    crashed = tmp_path / "crashed.log"
    crashed.write_text(FAILED_LOG)  # a checkpoint saved before a crash is no stop: no "continue" line for a bug
    assert closing_lines([SimpleNamespace(rule=job.rule, log=[str(crashed)])], argv) is None


def test_the_workflow_plans_without_importing_torch():
    """What the Snakefile imports to plan (pretrain_bench.workflow.pipeline and all it imports) loads no torch:
    importing it took 1.3 of a 2.9 s `snakemake -n` (docs/benchmarks/2026-12-07-dry-run.md). In a fresh process, as
    Snakemake's own."""
    import subprocess
    import sys

    probe = ("import sys; import pretrain_bench.workflow.pipeline; "
             "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "workflow_scripts")}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
