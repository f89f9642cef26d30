"""Where the data products live: the corpus, the tokenizer and the token shards belong to the settings that shape
them, not to a run's name, so every run with equal data settings shares one copy.

Each stage's folder is named by a short digest of exactly the settings that shape that stage, and sits inside the
folder of the stage it reads from:

    results/data/corpus-<c>/                                  train.jsonl, val.jsonl, manifest.json
    results/data/corpus-<c>/tokenizer-<t>/                    tokenizer.json and the HF tokenizer files
    results/data/corpus-<c>/tokenizer-<t>/shards-<s>/         {train,val}-NNNNN.bin + .json sidecars, index.json

<c> digests corpus.sources (with their pins), the cleaning keys and the split; <t> the tokenizer keys (or the adopted
tokenizer's path); <s> the shard layout. Nesting gives each product its inputs' ids too: a tokenizer edit makes a new
tokenizer (and shards) beside the same corpus, which is not cleaned again. The run's data id is the shards folder
relative to results/data (`corpus-<c>/tokenizer-<t>/shards-<s>`): it names every product the run reads. Editing a
data key makes a new id and leaves the old folders as they are. Keys that do not change the result (corpus.jobs, how
many processes clean; shards.verify, how a reader checks them) are left out of the digest.

An adopted tokenizer (tokenizer.path, or model.init_from's) is keyed by its content (`tokenizer_content_key`), not by
its path: continued pretraining from a sibling's export, whose tokenizer is the sibling's own, finds the tokenizer
product with the same content under its corpus and reuses it and its shards (`DataProducts.reused_tokenizer`).

Every product verifies what it serves: the shard jobs record the sha256 of the bytes they wrote, the tokenizer job
that of the files it wrote (WRITTEN_RECORD), and a product whose files no longer match is damaged
(`DamagedProductError`, with the command that rebuilds exactly it), never served or silently rebuilt.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pretrain_bench.config.schema import CorpusSettings, ShardSettings, TokenizerSettings
from pretrain_bench.data.tokenizer import (
    WRITTEN_RECORD,
    adopted_tokenizer_path,
    tokenizer_content_key,
    written_digests,
)

# Part of every digest: raise it when a stage writes something else for the same settings, so that no folder
# written by the old code is taken for the new one's.
LAYOUT_VERSION = 1
ID_HEX_DIGITS = 10
# corpus.* keys that say how the corpus is built, not what it holds: never part of its id.
CORPUS_EXECUTION_KEYS = ("jobs",)
# shards.* keys that say how a reader checks the shards, not what they hold.
SHARD_EXECUTION_KEYS = ("verify",)
# How the rebuild command an error gives starts (the user's own config files follow --configfile).
REBUILD_PREFIX = "snakemake --cores all --configfile <this run's config files>"


class DamagedProductError(RuntimeError):
    """A data product whose files are not what the job that built it wrote (changed, truncated, missing, or holding
    token ids outside its vocabulary); the message names the file and the command that rebuilds exactly that
    product."""


def rebuild_command(forced: list[str], target: str) -> str:
    """The command that rebuilds the products `forced` (their files) and then `target`: Snakemake reruns exactly
    those jobs and what reads them, deleting nothing by hand."""
    return f"{REBUILD_PREFIX} --forcerun {' '.join(forced)} -- {target}"


def damaged(what: str, problem: str, forced: list[str], target: str) -> DamagedProductError:
    """The error for a damaged product: `what` (its folder), the `problem` (naming the file), the command."""
    return DamagedProductError(f"the data product {what} is damaged: {problem}. Rebuild exactly it with:\n  "
                               f"{rebuild_command(forced, target)}")


def settings_digest(stage: str, settings: dict) -> str:
    """The first ID_HEX_DIGITS hex digits of the sha256 of `settings` as canonical JSON (sorted keys)."""
    text = json.dumps({"stage": stage, "layout": LAYOUT_VERSION, "settings": settings}, sort_keys=True,
                      separators=(",", ":"), default=list)
    return hashlib.sha256(text.encode()).hexdigest()[:ID_HEX_DIGITS]


def corpus_shaping(corpus: CorpusSettings) -> dict:
    """The corpus keys its content depends on: all but CORPUS_EXECUTION_KEYS, and the mixture's seed only when the
    sources form a mixture (it orders nothing otherwise)."""
    shaping = {key: value for key, value in corpus.as_dict().items() if key not in CORPUS_EXECUTION_KEYS}
    if not any(source.get("weight") is not None for source in shaping["sources"]):
        shaping.pop("seed", None)
    return shaping


def shards_shaping(shards: ShardSettings) -> dict:
    """The shard keys the shards depend on: all but SHARD_EXECUTION_KEYS."""
    return {key: value for key, value in shards.as_dict().items() if key not in SHARD_EXECUTION_KEYS}


def tokenizer_shaping(tokenizer: TokenizerSettings, adopted: str | None) -> dict:
    """The tokenizer keys its files depend on: the adopted tokenizer's content (its path where that cannot be read
    here, such as an hf:// name), or the BPE's size and sample."""
    if adopted:
        content = tokenizer_content_key(adopted)
        return {"adopted_content": content} if content else {"adopted": str(adopted)}
    return {"vocab_size": tokenizer.vocab_size, "train_bytes": tokenizer.train_bytes}


@dataclass(frozen=True)
class DataProducts:
    """The ids of one config's corpus, tokenizer and shards, and the paths they give."""

    corpus_id: str
    tokenizer_id: str
    shards_id: str
    # the adopted tokenizer is an existing tokenizer product with the same content (a sibling's export of it): that
    # product is read as it is, never written again
    reused_tokenizer: bool = False

    @classmethod
    def from_settings(cls, corpus: CorpusSettings, tokenizer: TokenizerSettings, shards: ShardSettings,
                      adopted_tokenizer: str | None) -> DataProducts:
        corpus_id = settings_digest("corpus", corpus_shaping(corpus))
        tokenizer_id = settings_digest("tokenizer", tokenizer_shaping(tokenizer, adopted_tokenizer))
        same = same_tokenizer_product(corpus_id, adopted_tokenizer) if adopted_tokenizer else None
        return cls(corpus_id=corpus_id, tokenizer_id=same or tokenizer_id,
                   shards_id=settings_digest("shards", shards_shaping(shards)), reused_tokenizer=same is not None)

    @classmethod
    def from_config(cls, corpus: CorpusSettings, tokenizer: TokenizerSettings, shards: ShardSettings,
                    init_from: str | None) -> DataProducts:
        """The data products of a config's settings (`init_from`: model.init_from, whose tokenizer is adopted when
        tokenizer.path is not set)."""
        return cls.from_settings(corpus, tokenizer, shards, adopted_tokenizer_path(tokenizer.path, init_from))

    @property
    def data_id(self) -> str:
        """The shards folder relative to results/data: names the corpus, tokenizer and shards a run reads."""
        return self.shards.removeprefix("data/")

    # Each product's folder relative to results/ (and to logs/ and benchmarks/, which mirror it).
    @property
    def corpus(self) -> str:
        return f"data/corpus-{self.corpus_id}"

    @property
    def tokenizer(self) -> str:
        return f"{self.corpus}/tokenizer-{self.tokenizer_id}"

    @property
    def shards(self) -> str:
        return f"{self.tokenizer}/shards-{self.shards_id}"

    @property
    def manifest(self) -> str:
        return f"results/{self.corpus}/manifest.json"

    @property
    def tokenizer_json(self) -> str:
        return f"results/{self.tokenizer}/tokenizer.json"

    @property
    def index(self) -> str:
        return f"results/{self.shards}/index.json"

    def record(self) -> dict:
        """What a run's plan, summary and model card say of its data: the id and each product's folder."""
        return {"data_id": self.data_id, "corpus": f"results/{self.corpus}", "tokenizer": f"results/{self.tokenizer}",
                "shards": f"results/{self.shards}"}


def same_tokenizer_product(corpus_id: str, adopted: str, results: Path = Path("results")) -> str | None:
    """The id of a tokenizer product of corpus `corpus_id` whose content (tokenizer_content_key) is the adopted
    tokenizer's, as its tokenizer job wrote it (WRITTEN_RECORD); None when there is none (or it cannot be read)."""
    wanted = tokenizer_content_key(adopted)
    corpus = Path(results, "data", f"corpus-{corpus_id}")
    if not wanted or not corpus.is_dir():
        return None
    for folder in sorted(corpus.glob("tokenizer-*")):
        try:
            record = json.loads((folder / WRITTEN_RECORD).read_text())
        except FileNotFoundError:
            record = None  # built before its job recorded what it wrote: its content is all there is to compare
        except (OSError, ValueError):
            continue
        if record is not None and record != written_digests(folder):
            continue  # edited in place: not the product its job wrote
        if tokenizer_content_key(folder) == wanted:
            return folder.name.removeprefix("tokenizer-")
    return None


def command_line_forcing(argv: list[str]) -> tuple[set[str], bool]:
    """(--forcerun/-R targets, --forceall/-F) of a Snakemake command line: the workflow is parsed before Snakemake
    hands it its DAG settings, so checks made while parsing read them here."""
    forcerun, forceall, taking = set(), False, False
    for arg in argv[1:]:
        if arg in ("--forceall", "-F"):
            forceall, taking = True, False
        elif arg in ("--forcerun", "-R"):
            taking = True
        elif arg.startswith("--forcerun="):
            forcerun.add(arg.split("=", 1)[1])
            taking = True
        elif arg.startswith("-"):
            taking = False
        elif taking:
            forcerun.add(arg)
    return forcerun, forceall


def forced(path: str, rule: str, forcerun, forceall: bool = False) -> bool:
    """Whether Snakemake was told to rebuild `path` (made by `rule`): --forceall, or --forcerun naming either."""
    return forceall or bool({path, rule} & {str(target) for target in forcerun or ()})


def tokenizer_problem(products: DataProducts, forcerun=(), forceall: bool = False) -> str | None:
    """Why this config's tokenizer product cannot be served: its files are not those its tokenizer job wrote
    (edited by hand), so the shards encoded with it do not match it; None when they are (or it is not built yet, was
    built before the job recorded them, or this command rebuilds it: --forcerun naming it or its rule)."""
    if forced(products.tokenizer_json, "train_tokenizer", forcerun, forceall):
        return None
    folder = Path("results", products.tokenizer)
    try:
        record = json.loads((folder / WRITTEN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    changed = [name for name, digest in written_digests(folder).items() if record.get(name) != digest]
    if not changed:
        return None
    return str(damaged(
        f"results/{products.tokenizer}",
        f"{', '.join(str(folder / name) for name in changed)} is not the file its tokenizer job wrote (its sha256 "
        "changed), so the shards encoded with it no longer match it. To train with an edited tokenizer, copy its "
        "folder out of results/ and set tokenizer.path to the copy: a new product, keyed by its content",
        [products.tokenizer_json], products.index))


def missing_tokenizer_problem(path: str | None, trained: DataProducts) -> str | None:
    """Why tokenizer.path cannot be adopted yet when it names a missing folder under results/ where a tokenizer is a
    data product, with the target that builds it; None otherwise (it exists, lies outside results/, or names another
    run's output, such as its HF export, which the workflow checks as such). `trained`: the data products of this
    config with tokenizer.path left out, whose tokenizer is the one its own corpus and tokenizer settings train.

    Two such places: a tokenizer folder under results/data/ that no run has built yet, and results/<run>/tokenizer,
    where a run kept its tokenizer before tokenizers became data products."""
    if not path or path.startswith("hf://"):
        return None
    folder = Path(path.removeprefix("file://"))
    try:
        parts = folder.resolve().relative_to(Path("results").resolve()).parts
    except ValueError:
        return None
    if folder.exists() or len(parts) < 2:
        return None
    own = f"results/{trained.tokenizer}"
    if parts[0] == "data":
        product = "/".join(parts[:3])
        build = ("leave tokenizer.path out: this config's own corpus and tokenizer settings train it"
                 if f"results/{product}" == own else
                 "build it with the config files whose corpus and tokenizer settings give that id:\n  snakemake "
                 f"--cores all --configfile <those config files> -- results/{product}/tokenizer.json")
        return f"tokenizer.path {path}: no run has built that tokenizer yet (no {folder}); {build}"
    if parts[1] != "tokenizer":
        return None
    run = parts[0]
    where = (f"tokenizer.path {path}: run {run!r} keeps no tokenizer there; a tokenizer is a data product, under "
             "results/data/corpus-<c>/tokenizer-<t>/ by the digest of the settings that shape it, shared by every "
             "run with the same data settings")
    recorded = _planned_tokenizer(Path("results", run, "train", "plan.json"))
    if recorded:
        return f"{where}. Run {run!r} reads {recorded}: set tokenizer.path to that folder"
    build = "" if Path(own).exists() else (
        f", built by: snakemake --cores all --configfile <this config's files> -- {own}/tokenizer.json")
    return (f"{where}. If run {run!r} has this config's corpus and tokenizer settings, its tokenizer is {own}{build}; "
            f"otherwise build run {run!r}'s with its config files and set tokenizer.path to the folder Snakemake "
            f"names:\n  snakemake --cores all --configfile <its config files> --config name={run} --until "
            "train_tokenizer")


def _planned_tokenizer(plan: Path) -> str | None:
    """The tokenizer folder a run's plan.json names (its data record), None without one."""
    try:
        return json.loads(plan.read_text())["data"]["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
