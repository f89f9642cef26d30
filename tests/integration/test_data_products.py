"""The corpus, tokenizer and shards belong to the data settings, not to a run's name: under results/data/ by the
digest of what shapes each, shared by every run with the same data settings, through Snakemake."""
import hashlib
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain_bench.data.products import missing_tokenizer_problem
from pretrain_bench.data.shards import verify_index
from support import (
    TINY_CONFIG,
    data_folders,
    data_products,
    job_logs,
    plan_for,
    run,
    run_snakemake,
    scheduled_rules,
    snakemake_command,
    snakemake_env,
    tree_digest,
    workflow_dir,
    write_yaml,
)

pytestmark = pytest.mark.pipeline

DATA_RULES = {"clean_corpus_part", "download_corpus", "train_tokenizer", "shard_tokens", "index_shards"}


def test_a_second_name_with_the_same_data_settings_schedules_no_data_job(workdir):
    proc = run_snakemake(workdir, "-n", "--config", "name=itest-other-name")
    rules = scheduled_rules(proc)
    assert {"plan_pretrain", "pretrain"} <= rules, "the new name trains"
    assert not rules & DATA_RULES, f"{sorted(rules & DATA_RULES)} rebuilt data another name already built"
    assert data_products().index in proc.stdout + proc.stderr, "its plan reads the shared shards"


def test_the_data_id_ignores_the_run_name_and_the_training_keys():
    tiny = data_products()
    assert data_products({"name": "another", "train": {"lr": 0.5}, "model": {"seq_len": 64}}) == tiny
    assert tiny.data_id == f"corpus-{tiny.corpus_id}/tokenizer-{tiny.tokenizer_id}/shards-{tiny.shards_id}"


def corpus_and_shards(folders) -> dict:
    """Digests of the corpus's own files (its folder also holds the tokenizers made from it) and of the shards."""
    corpus = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in folders.corpus.glob("*.json*")}
    assert set(corpus) == {"train.jsonl", "val.jsonl", "manifest.json"}
    return {"corpus": corpus, "shards": tree_digest(folders.shards)}


def test_a_data_edit_builds_new_products_beside_the_old_and_only_what_it_shapes(workdir):
    old, edited = data_products(), data_products({"shards": {"count": 3}})
    assert edited.corpus == old.corpus and edited.tokenizer == old.tokenizer and edited.shards != old.shards
    folders = data_folders(workdir)
    before = corpus_and_shards(folders)
    corpus_mtime = (folders.corpus / "train.jsonl").stat().st_mtime_ns
    edit = ("--config", "name=itest-three-shards", 'shards={"count": 3}', "--", edited.index)
    # the run's own job table: what it scheduled
    assert scheduled_rules(run_snakemake(workdir, *edit)) == {"shard_tokens", "index_shards"}
    index = json.loads((workdir / edited.index).read_text())
    assert [len(index["splits"][split]["shards"]) for split in ("train", "val")] == [3, 3]
    old_index = json.loads((folders.shards / "index.json").read_text())
    assert index["splits"]["train"]["tokens"] == old_index["splits"]["train"]["tokens"], "the same token stream"
    # the old products stay as they were: the corpus not cleaned again, the two-shard layout kept
    assert corpus_and_shards(folders) == before
    assert (folders.corpus / "train.jsonl").stat().st_mtime_ns == corpus_mtime
    # and the original settings still find everything up to date
    assert scheduled_rules(run_snakemake(workdir, "-n", "--", old.index, old.tokenizer_json)) == set()


def test_a_local_source_that_cannot_be_read_as_named_stops_the_dry_run_naming_it(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.md").write_text("# a text file of any name is read")
    (tmp_path / "texts" / "b.txt.gz").write_text("plain text behind a .gz name")
    source = f"file://{tmp_path}/texts/*"
    overlay = write_yaml(tmp_path / "overlay.yaml",
                         {"name": "itest-bad-source", "corpus": {"sources": [{"uri": source}]}})
    proc = run_snakemake(workflow_dir(tmp_path / "workflow"), "-n", configfiles=(TINY_CONFIG, overlay), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert (f"corpus.sources: {source}: {tmp_path}/texts/b.txt.gz is named .gz but does not hold .gz data "
            "(it starts with b'plai')") in out, out[-3000:]
    assert "Traceback" not in out


def test_cleaning_in_three_part_jobs_writes_the_corpus_one_job_writes(tmp_path):
    (tmp_path / "texts").mkdir()
    for number in range(6):
        (tmp_path / "texts" / f"{number}.py").write_text(f"def function_{number}():\n    return {number}\n" * 20)
    (tmp_path / "texts" / "6.py").write_text((tmp_path / "texts" / "0.py").read_text())  # a duplicate, parts apart
    outputs = {}
    for jobs in (1, 3):
        edit = {"name": f"itest-jobs{jobs}", "corpus": {"sources": [{"uri": f"file://{tmp_path}/texts/*.py"}],
                                                        "jobs": jobs, "val_fraction": 0.3}}
        products = data_products(edit)
        folder = workflow_dir(tmp_path / f"jobs{jobs}")
        overlay = write_yaml(tmp_path / f"jobs{jobs}.yaml", edit)
        # the run's own job table and job lines: what it scheduled
        built = run_snakemake(folder, "--", products.manifest, configfiles=(TINY_CONFIG, overlay))
        assert scheduled_rules(built) == ({"download_corpus"} if jobs == 1 else {"clean_corpus_part",
                                                                                  "download_corpus"})
        assert (built.stdout + built.stderr).count("rule clean_corpus_part:") == (0 if jobs == 1 else 3)
        corpus = folder / "results" / products.corpus
        outputs[jobs] = {name: (corpus / name).read_bytes() for name in ("train.jsonl", "val.jsonl")}
        manifest = json.loads((corpus / "manifest.json").read_text())
        assert manifest["documents"] == 6 and manifest["dropped"]["duplicate"] == 1
        assert not (corpus / "parts").exists() or not any((corpus / "parts").iterdir()), "the parts are temporary"
    assert data_products({"corpus": {"jobs": 1}}) == data_products({"corpus": {"jobs": 3}}), "jobs is no data key"
    assert outputs[3] == outputs[1]


def test_a_missing_tokenizer_path_names_the_data_product_target_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trained = data_products()  # the tiny config trains its tokenizer: tokenizer.path is null
    own = f"results/{trained.tokenizer}"
    # where a run kept its tokenizer before tokenizers were data products: the folder this config's settings train
    problem = missing_tokenizer_problem("results/other-run/tokenizer", trained)
    assert problem.startswith("tokenizer.path results/other-run/tokenizer: run 'other-run' keeps no tokenizer there")
    assert f"its tokenizer is {own}, built by: snakemake --cores all --configfile <this config's files> -- " \
           f"{own}/tokenizer.json" in problem
    assert "--config name=other-run --until train_tokenizer" in problem
    assert "-- results/other-run/tokenizer" not in problem, "the old layout is never a target"
    # once that run has planned, its plan names the tokenizer it reads
    plan = tmp_path / "results" / "other-run" / "train" / "plan.json"
    plan.parent.mkdir(parents=True)
    plan.write_text(json.dumps({"data": {"tokenizer": "results/data/corpus-a/tokenizer-b"}}))
    assert missing_tokenizer_problem("results/other-run/tokenizer", trained).endswith(
        "Run 'other-run' reads results/data/corpus-a/tokenizer-b: set tokenizer.path to that folder")
    # a data product no run has built: its own target; this config's own tokenizer: leave the key out
    problem = missing_tokenizer_problem("results/data/corpus-a/tokenizer-b", trained)
    assert problem.endswith("-- results/data/corpus-a/tokenizer-b/tokenizer.json")
    assert "leave tokenizer.path out" in missing_tokenizer_problem(own, trained)
    # what exists, lies outside results/, or is another run's export is not this check's
    (tmp_path / own).mkdir(parents=True)
    assert missing_tokenizer_problem(own, trained) is None
    assert missing_tokenizer_problem(str(tmp_path / "elsewhere"), trained) is None
    assert missing_tokenizer_problem("results/other-run/train/hf", trained) is None


def test_the_dry_run_stops_on_a_tokenizer_path_under_results_data_that_is_not_built(tmp_path):
    overlay = write_yaml(tmp_path / "overlay.yaml", {"name": "itest-missing-tokenizer",
                                                      "tokenizer": {"path": "results/data/corpus-x/tokenizer-y"}})
    proc = run_snakemake(workflow_dir(tmp_path / "workflow"), "-n", configfiles=(TINY_CONFIG, overlay), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "tokenizer.path results/data/corpus-x/tokenizer-y: no run has built that tokenizer yet" in out, out[-3000:]
    assert "-- results/data/corpus-x/tokenizer-y/tokenizer.json" in out and "run 'data'" not in out


def test_two_pipelines_building_the_same_data_at_once_both_finish_with_the_products_one_builds(tiny_data, tmp_path):
    """Two experiments at once (--nolock, one working directory, started in the same second) on one data id: each
    data job that finds the other pipeline building its product waits for it and uses it; nothing is deleted under
    the other, and the products are byte for byte those one pipeline builds alone."""
    products = data_products()
    workdir = workflow_dir(tmp_path / "workflow")
    targets = ("--", products.index, products.tokenizer_json)
    procs = [subprocess.Popen(snakemake_command("--nolock", "--config", f"name=itest-at-once-{n}", *targets),
                              cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=snakemake_env()) for n in (1, 2)]
    outputs = [proc.communicate(timeout=1800)[0] for proc in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, f"{output[-4000:]}\n{job_logs(workdir)}"
        assert "Removing output files of failed job" not in output
    assert "waiting for pid" in "".join(outputs) + job_logs(workdir), "the second pipeline waited for the first"
    built, alone = data_folders(workdir), data_folders(tiny_data)
    for folder in ("corpus", "tokenizer", "shards"):
        exclude = ("tokenizer-", "shards-") if folder != "shards" else ()
        assert product_digests(getattr(built, folder), exclude) == product_digests(getattr(alone, folder), exclude), \
            folder
    assert verify_index(workdir / products.index, "full")["splits"]["train"]["tokens"] > 0


def product_digests(folder: Path, exclude: tuple[str, ...]) -> dict:
    """sha256 of each file of a product folder (not of the products nested in it, nor of hidden lock files)."""
    return {path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()
            and not path.relative_to(folder).as_posix().startswith(exclude)}


def test_continued_pretraining_from_a_siblings_export_reuses_its_tokenizer_and_shards(workdir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    products = data_products()
    export = workdir / "results" / "itest-sibling" / "train" / "hf"
    # the sibling's export, as evaluate.export writes it: a LLaMA model and the data product's tokenizer saved again
    tokenizer = AutoTokenizer.from_pretrained(workdir / products.tokenizer_json.rsplit("/", 1)[0],
                                              local_files_only=True)
    tokenizer.save_pretrained(export)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                 max_position_embeddings=256, tie_word_embeddings=True)).save_pretrained(export)
    overlay = write_yaml(workdir / "continued.yaml", {"name": "itest-continued",
                                                       "model": {"init_from": "results/itest-sibling/train/hf"}})
    proc = run_snakemake(workdir, "-n", "--", "results/itest-continued/train/plan.json",
                         configfiles=(TINY_CONFIG, overlay))
    rules = scheduled_rules(proc)
    assert "plan_pretrain" in rules
    assert not rules & DATA_RULES, f"{sorted(rules & DATA_RULES)} scheduled for a tokenizer with the same bytes"
    assert products.index in proc.stdout + proc.stderr, "its plan reads the sibling's shards"


def test_a_shard_overwritten_in_place_stops_the_launch_naming_it_before_any_rank_starts(data, tmp_path):
    """The issue's probe: same size and mtime kept, so neither Snakemake nor a size check sees it; the launcher's
    check of the bytes against the digests recorded when the shard was written does (shards.verify: full)."""
    import shutil

    config, folders = data
    copy = SimpleNamespace(tokenizer=tmp_path / "tokenizer", shards=tmp_path / "tokenizer" / "shards")
    shutil.copytree(folders.tokenizer, copy.tokenizer, ignore=shutil.ignore_patterns("shards-*"))
    shutil.copytree(folders.shards, copy.shards)
    shard = copy.shards / "train-00001.bin"
    stat = shard.stat()
    with open(shard, "r+b") as handle:
        handle.seek(stat.st_size // 2)
        handle.write(b"\x07\x00" * 8)  # valid ids, another text
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    plan = plan_for((config, copy), tmp_path / "run", gpus=1)
    log = tmp_path / "launch.log"
    assert run(plan, 1, log) == 2
    out = log.read_text()
    assert f"the data product {copy.shards} is damaged: {shard} does not match the sha256 its shard job recorded " \
           "from the bytes it wrote" in out, out[-3000:]
    assert f"--forcerun {shard} -- {copy.shards / 'index.json'}" in out
    assert "Traceback" not in out and not (tmp_path / "run" / "state" / "checkpoints").exists()


def test_a_damaged_shared_product_is_named_before_any_job_and_its_command_rebuilds_exactly_it(workdir):
    products = data_products()
    folders = data_folders(workdir)
    index = workdir / products.index
    before = index.read_bytes()
    shard = folders.shards / "val-00000.bin"
    with open(shard, "r+b") as handle:  # other bytes of the same size, and a newer mtime: Snakemake reruns the index
        handle.seek(8)
        handle.write(b"\x07\x00" * 4)
    failed = run_snakemake(workdir, "--", products.index, check=False)
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0
    relative = f"results/{products.shards}/val-00000.bin"
    assert f"the data product results/{products.shards} is damaged: {relative} does not match the sha256" in out, \
        out[-3000:]
    command = f"--forcerun {relative} -- {products.index}"
    assert command in out and "Traceback" not in out
    assert index.read_bytes() == before, "the shared index is never deleted on the way"
    # the command it gives (with this run's config files) rebuilds that shard and the index, nothing else
    rebuilt = run_snakemake(workdir, *command.split())
    assert scheduled_rules(rebuilt) == {"shard_tokens", "index_shards"}
    assert (rebuilt.stdout + rebuilt.stderr).count("rule shard_tokens:") == 1
    assert index.read_bytes() == before and verify_index(index, "full")
    # a tokenizer edited in place is named too: its shards are never encoded again under the same id
    tokenizer = workdir / products.tokenizer_json
    tokenizer.write_text(tokenizer.read_text().replace('"<|pad|>"', '"<pad>"'))
    failed = run_snakemake(workdir, "-n", "--", products.index, check=False)
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0 and f"{products.tokenizer_json} is not the file its tokenizer job wrote" in out
    assert "Job stats:" not in out, "no job scheduled"
