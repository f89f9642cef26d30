"""What `snakemake -n` refuses or plans from the command line, in a working directory of its own: one GPU count
(--resources gpu against train.gpus), short config errors naming the dotted key, finite numbers and run names
Snakemake can take; and a real failing job whose terminal ends with its own lines, not a traceback."""
import subprocess

from support import snakemake_command, snakemake_env, workflow_dir, write_yaml

MAX_ERROR_LINES = 15


def dry_run(workdir, *args, gpu=3, configfiles=("config/tiny-cpu.yaml",)):
    """`snakemake -n -p` with `--resources gpu=<gpu>` in `workdir`."""
    command = [arg if arg != "gpu=3" else f"gpu={gpu}"
               for arg in snakemake_command("-n", "-p", *args, configfiles=configfiles)]
    return subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=snakemake_env(), timeout=600)


def refusal(proc) -> str:
    """The error Snakemake printed, from the line naming where it was raised on, checked to be short."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    out = proc.stdout + proc.stderr  # Snakemake prints a Snakefile's error on stdout
    text = out[out.index("Error in file"):] if "Error in file" in out else out
    assert len(text.strip().splitlines()) <= MAX_ERROR_LINES, text
    assert "Failed validating" not in text and "schema[" not in text and "Traceback" not in text, text
    return text


def test_explicit_gpus_above_the_gpu_resource_is_refused_and_auto_takes_it(tmp_path):
    workdir = workflow_dir(tmp_path / "w")
    text = refusal(dry_run(workdir, gpu=2))  # the tiny config's train.gpus: 3
    assert "train.gpus 3 but --resources gpu=2" in text
    auto = dry_run(workdir, "--config", 'train={"gpus": "auto"}', gpu=2)
    assert auto.returncode == 0, auto.stderr[-3000:]
    out = auto.stdout + auto.stderr
    assert "launch.py --ranks 2 --plan results/tiny-cpu/train/plan.json" in out
    # the matrix's 3-rank gloo cell is left out for the resource, as its nccl cells are for the CPU
    assert "ranks3-zero2-fp32-gloo: not supported here: needs 3 GPUs, --resources gpu=2" in out
    assert "--ranks 3" not in out


def test_config_errors_name_the_dotted_key_in_a_few_lines(tmp_path):
    workdir = workflow_dir(tmp_path / "w")
    text = refusal(dry_run(workdir, "--config", 'train={"lr_schedule": "cosin"}'))
    assert "train.lr_schedule: 'cosin' is not allowed" in text and "did you mean 'cosine'?" in text
    overlay = write_yaml(workdir / "price.yaml", {"report": {"gpu_hour_price": 2.5}})
    text = refusal(dry_run(workdir, configfiles=("config/tiny-cpu.yaml", overlay)))
    assert "report.gpu_hour_price: 2.5 is not allowed" in text and "allowed: a mapping or null" in text
    text = refusal(dry_run(workdir, "--config", 'evaluate={"generation": {"top_kk": 4}}'))
    # (--config reads the value as the string '4')
    assert "evaluate.generation.top_kk: not a config key (given: '4'); did you mean 'top_k'?" in text


def test_nan_and_periodic_names_are_refused_naming_the_key(tmp_path):
    workdir = workflow_dir(tmp_path / "w")
    for key, value in (("lr", ".nan"), ("weight_decay", ".inf"), ("grad_clip", "-.inf")):
        text = refusal(dry_run(workdir, "--config", f'train={{"{key}": "{value}"}}'))
        assert f"train.{key}: " in text and "is not a finite number" in text
    text = refusal(dry_run(workdir, "--config", "name=run-0000000000000000000000"))
    assert "name 'run-0000000000000000000000' ends in '0' repeated 22 times" in text
    assert "PeriodicWildcardError" not in text


def test_a_failed_job_ends_the_terminal_with_its_cause_not_a_traceback(tmp_path):
    """A real job failing: the corpus's file source holds bytes that are not UTF-8 under encoding_errors strict."""
    workdir = workflow_dir(tmp_path / "w")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good text\n" * 50 + b"\xff\xfe broken\n")
    overlay = write_yaml(workdir / "bad.yaml", {"name": "broken", "corpus": {
        "sources": [{"uri": f"file://{bad}"}], "encoding_errors": "strict", "jobs": 1}})
    command = snakemake_command("--", "results/broken/train/plan.json",
                                configfiles=("config/tiny-cpu.yaml", overlay))
    proc = subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=snakemake_env(), timeout=900)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    tail = out[out.index("What the stopped job(s) said"):]
    assert "rule download_corpus (logs/data/corpus-" in tail
    assert str(bad) in tail and "Traceback" not in tail and 'File "' not in tail


def test_expert_parallelism_on_a_model_without_experts_is_refused_at_planning(tmp_path):
    workdir = workflow_dir(tmp_path / "w")
    text = refusal(dry_run(workdir, "--config", 'train={"expert_parallel": 3}'))
    assert "train.expert_parallel 3 needs a model with routed experts, and model.preset tiny (LLaMA) has none" in text
