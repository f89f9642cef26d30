"""pretrain_bench.data.corpus: formats, cleaning counters, split, cap, failures, builtin and hf sources, the rule."""
import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from pretrain_bench.data.corpus import CorpusError, build_corpus, jsonl_line
from pretrain_bench.data.download import sha256_file
from pretrain_bench.data.sources import local_source_files

ROOT = Path(__file__).parents[2]

DEFAULTS = {"max_bytes": None, "min_chars": 1, "dedup": True, "val_fraction": 0.1, "encoding_errors": "replace"}


def build(tmp_path: Path, sources: list[dict], out: str = "out", **settings) -> dict:
    return build_corpus(sources, tmp_path / out, cache_dir=tmp_path / "cache", **{**DEFAULTS, **settings})


def read_split(out_dir: Path, split: str) -> list[str]:
    return [json.loads(line)["text"] for line in (out_dir / f"{split}.jsonl").read_text("utf-8").splitlines()]


def written(out_dir: Path) -> list[str]:
    """Every written document, train then val."""
    return read_split(out_dir, "train") + read_split(out_dir, "val")


def is_val(text: str, val_fraction: float) -> bool:
    """The documented split rule, recomputed independently of the implementation."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < val_fraction * 2**64


def uri(path: Path) -> str:
    return f"file://{path}"


def write_jsonl(path: Path, records: list, compress=None) -> Path:
    data = "".join(json.dumps(record) + "\n" for record in records).encode()
    path.write_bytes(compress(data) if compress else data)
    return path


DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(60)]


# ------------------------------------------------------------------------------------------------------ formats


def test_txt_one_document_per_file_in_sorted_glob_order(tmp_path):
    (tmp_path / "data").mkdir()
    for name, text in [("b.txt", "second file"), ("a.txt", "first file"), ("c.md", "not matched"),
                       ("sub/d.txt", "nested file")]:
        (tmp_path / "data" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "data" / name).write_text(text)
    manifest = build(tmp_path, [{"uri": uri(tmp_path / "data" / "**" / "*.txt")}], val_fraction=0.01)
    # With three documents and val_fraction 0.01 val comes from the fallback; order is checked on all of them.
    assert sorted(written(tmp_path / "out")) == ["first file", "nested file", "second file"]
    train = read_split(tmp_path / "out", "train")
    assert train == [t for t in ["first file", "second file", "nested file"] if t in train]
    assert manifest["sources"][0]["details"]["files"] == 3


PNG_HEAD = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


def test_hidden_files_of_a_glob_are_skipped_and_counted_unless_included(tmp_path):
    tree = tmp_path / "tree"
    for name, text in {"a.py": "x = 1\n", "pkg/b.py": "y = 2\n", ".hidden.py": "z = 3\n",
                       ".git/hooks/c.py": "w = 4\n", "pkg/.cache/d.py": "v = 5\n"}.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    source = {"uri": uri(tree / "**" / "*.py")}
    manifest = build(tmp_path, [source], val_fraction=0.3)
    assert sorted(written(tmp_path / "out")) == ["x = 1\n", "y = 2\n"]
    assert manifest["skipped"] == {"binary": 0, "hidden": 3}
    details = manifest["sources"][0]["details"]
    assert manifest["sources"][0]["hidden_skipped"] == 3
    assert details["hidden_files"] == sorted(str(tree / name) for name in (".git/hooks/c.py", ".hidden.py",
                                                                            "pkg/.cache/d.py"))
    assert local_source_files([source]) == sorted(str(tree / name) for name in ("a.py", "pkg/b.py"))
    # include_hidden: read like any other file, and an input of the corpus
    included = build(tmp_path / "with", [{**source, "include_hidden": True}], val_fraction=0.3)
    assert included["documents"] == 5 and included["skipped"] == {"binary": 0, "hidden": 0}
    assert len(local_source_files([{**source, "include_hidden": True}])) == 5


def test_any_text_file_is_a_document_and_binary_files_are_skipped_and_counted(tmp_path):
    """A glob over a source tree: every name that is not .jsonl/.parquet is text (.py, .md, .rst, .c, no suffix,
    a gzipped .txt), records keep their meaning, and binaries (a NUL in the first 8 KiB, or mostly invalid UTF-8
    without any NUL) are skipped, named and counted rather than cleaned into the corpus."""
    tree = tmp_path / "tree"
    texts = {"a.py": "def f():\n    return 1\n", "b.md": "# Title\n\nsome prose", "c.rst": "Section\n=======\n",
             "d.c": "int main(void) { return 0; }\n", "Makefile": "all:\n\techo hi\n"}
    for name, text in texts.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    (tree / "e.txt.gz").write_bytes(gzip.compress(b"gzipped plain text"))
    write_jsonl(tree / "f.jsonl", [{"text": "a record"}, {"text": "another record"}])
    (tree / "image.png").write_bytes(PNG_HEAD + bytes(range(256)) * 4)
    (tree / "blob.bin").write_bytes(bytes(b for b in os.urandom(20_000) if b))  # random bytes without a NUL
    manifest = build(tmp_path, [{"uri": uri(tree / "*")}], val_fraction=0.3)
    assert sorted(written(tmp_path / "out")) == sorted([*texts.values(), "gzipped plain text", "a record",
                                                        "another record"])
    source = manifest["sources"][0]
    assert manifest["binary_skipped"] == source["binary_skipped"] == 2
    assert sorted(source["details"]["binary_files"]) == [f"{tree / name} ({uri(tree / '*')})"
                                                         for name in ("blob.bin", "image.png")]
    assert source["details"]["files"] == 9 and len(source["details"]["file_sha256"]) == 9


def test_latin1_text_is_text_with_replacements_not_binary(tmp_path):
    (tmp_path / "notes.txt").write_bytes("café crème, déjà vu: naïve façade ".encode("latin-1") * 50)
    (tmp_path / "other.txt").write_text("a second document")
    manifest = build(tmp_path, [{"uri": uri(tmp_path / "*.txt")}], val_fraction=0.3)
    assert manifest["binary_skipped"] == 0 and manifest["documents"] == 2 and manifest["replaced_chars"] == 50 * 6


def test_sources_are_checked_before_reading_naming_the_uri(tmp_path):
    from pretrain_bench.data.sources import local_files

    (tmp_path / "fake.jsonl.gz").write_text('{"text": "not compressed"}\n')
    with pytest.raises(CorpusError, match=rf"^file://{tmp_path}/\*\.gz: {tmp_path}/fake\.jsonl\.gz is named \.gz but "
                                          r"does not hold \.gz data"):
        local_files(uri(tmp_path / "*.gz"))
    (tmp_path / "hidden.jsonl").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n'))
    with pytest.raises(CorpusError, match=r"hidden\.jsonl holds \.zst compressed data but its name does not end in "
                                          r"\.zst: rename it to hidden\.jsonl\.zst"):
        local_files(uri(tmp_path / "hidden.jsonl"))
    (tmp_path / "good.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"text"))
    assert local_files(uri(tmp_path / "good.txt.zst")) == [str(tmp_path / "good.txt.zst")]
    if os.geteuid() != 0:  # root reads any file
        (tmp_path / "locked.txt").write_text("x")
        (tmp_path / "locked.txt").chmod(0)
        with pytest.raises(CorpusError, match=r"locked\.txt.*: cannot read .*locked\.txt: Permission denied"):
            local_files(uri(tmp_path / "locked.txt"))


def test_txt_paragraphs_split_on_blank_lines(tmp_path):
    text = "p1 line1\np1 line2\n\n\np2\n  \t\np3\r\n\r\np4\n\n"
    (tmp_path / "a.txt").write_text(text, newline="")
    build(tmp_path, [{"uri": uri(tmp_path / "a.txt"), "split": "paragraphs"}], val_fraction=0.5)
    assert sorted(written(tmp_path / "out")) == ["p1 line1\np1 line2", "p2", "p3", "p4"]


def test_jsonl_text_field_blank_lines_and_null(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "alpha", "id": 1}\n\n{"body": null}\n{"body": "beta \\u00e9\\u4e2d"}\n')
    manifest = build(tmp_path, [{"uri": uri(path), "text_field": "body"}], val_fraction=0.5)
    assert sorted(written(tmp_path / "out")) == ["alpha", "beta é中"]
    assert manifest["sources"][0]["documents_in"] == 3
    assert manifest["dropped"]["too_short"] == 1  # the null


def test_jsonl_missing_field_names_file_line_and_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"content": "no text key"}])
    with pytest.raises(CorpusError, match=r"d\.jsonl.* line 2: no 'text' key .*\['content'\]"):
        build(tmp_path, [{"uri": uri(path)}])


def test_jsonl_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(CorpusError, match=r"d\.jsonl.* line 2: invalid JSON"):
        build(tmp_path, [{"uri": uri(path)}])


def test_parquet_text_field(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "content": DOCS}), path, row_group_size=7)
    build(tmp_path, [{"uri": uri(path), "text_field": "content"}])
    assert sorted(written(tmp_path / "out")) == sorted(DOCS)
    with pytest.raises(CorpusError, match=r"no column 'text'.*\['id', 'content'\]"):
        build(tmp_path, [{"uri": uri(path)}], out="out2")
    with pytest.raises(CorpusError, match="'id' .* not a string column"):
        build(tmp_path, [{"uri": uri(path), "text_field": "id"}], out="out3")


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress),
                                              (".zst", lambda data: zstandard.ZstdCompressor().compress(data))])
def test_compressed_txt_jsonl_parquet(tmp_path, suffix, compress):
    (tmp_path / f"a.txt{suffix}").write_bytes(compress(b"a whole text file\n\nwith two paragraphs"))
    write_jsonl(tmp_path / f"b.jsonl{suffix}", [{"text": doc} for doc in DOCS[:20]], compress)
    table_bytes = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": DOCS[20:40]}), table_bytes)
    (tmp_path / f"c.parquet{suffix}").write_bytes(compress(table_bytes.getvalue().to_pybytes()))
    sources = [{"uri": uri(tmp_path / f"a.txt{suffix}")}, {"uri": uri(tmp_path / f"b.jsonl{suffix}")},
               {"uri": uri(tmp_path / f"c.parquet{suffix}")}]
    manifest = build(tmp_path, sources)
    assert sorted(written(tmp_path / "out")) == sorted(["a whole text file\n\nwith two paragraphs", *DOCS[:40]])
    assert [source["documents_out"] for source in manifest["sources"]] == [1, 20, 20]


def test_zst_with_several_frames_is_read_whole(tmp_path):
    frames = b"".join(zstandard.ZstdCompressor().compress(f'{{"text": "doc {i}"}}\n'.encode()) for i in range(3))
    (tmp_path / "d.jsonl.zst").write_bytes(frames)
    build(tmp_path, [{"uri": uri(tmp_path / "d.jsonl.zst")}], val_fraction=0.5)
    assert sorted(written(tmp_path / "out")) == ["doc 0", "doc 1", "doc 2"]


def test_corrupt_gzip_names_the_file(tmp_path):
    (tmp_path / "d.txt.gz").write_bytes(gzip.compress(b"some text")[:-6])
    with pytest.raises(CorpusError, match=r"d\.txt\.gz.*cannot read"):
        build(tmp_path, [{"uri": uri(tmp_path / "d.txt.gz")}])


def test_missing_file_and_empty_glob_name_the_uri(tmp_path):
    missing = uri(tmp_path / "nope.txt")
    with pytest.raises(CorpusError, match=f"{missing}: no such file"):
        build(tmp_path, [{"uri": missing}])
    empty_glob = uri(tmp_path / "*.jsonl")
    with pytest.raises(CorpusError, match=rf"{empty_glob.replace('*', '[*]')}: the glob matched no files"):
        build(tmp_path, [{"uri": empty_glob}])


def test_misplaced_keys_are_rejected(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(CorpusError, match="'sha256' applies to http"):
        build(tmp_path, [{"uri": uri(tmp_path / "a.txt"), "sha256": "0" * 64}])
    with pytest.raises(CorpusError, match="split 'train' is for hf:// sources"):
        build(tmp_path, [{"uri": uri(tmp_path / "a.txt"), "split": "train"}])
    with pytest.raises(CorpusError, match="corpus.val_fraction"):
        build(tmp_path, [{"uri": uri(tmp_path / "a.txt")}], val_fraction=0)
    with pytest.raises(CorpusError, match="unknown builtin corpus"):
        build(tmp_path, [{"uri": "builtin://nothing"}])


# ----------------------------------------------------------------------------------------------------- cleaning


def test_cleaning_counters(tmp_path):
    docs = ["kept document one", "kept\x00 document\x00 two", "   tiny  ", "kept document one", "", "x" * 9]
    manifest = build(tmp_path, [{"uri": uri(write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs]))}],
                     min_chars=9, val_fraction=0.5)
    assert sorted(written(tmp_path / "out")) == ["kept document one", "kept document two", "xxxxxxxxx"]
    assert manifest["nul_removed"] == 2
    assert manifest["dropped"] == {"too_short": 2, "duplicate": 1, "over_cap": 0}
    source = manifest["sources"][0]
    assert (source["documents_in"], source["documents_out"]) == (6, 3)
    assert source["bytes_in"] == sum(len(d.encode()) for d in docs)
    assert manifest["bytes"] == source["bytes_out"] == len("kept document one" "kept document two" "xxxxxxxxx")


def test_dedup_off_keeps_duplicates(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "same text"}] * 3 + [{"text": "other"}])
    manifest = build(tmp_path, [{"uri": uri(path)}], dedup=False, val_fraction=0.5)
    assert sorted(written(tmp_path / "out")) == ["other", "same text", "same text", "same text"]
    assert manifest["dropped"]["duplicate"] == 0


def test_replace_counts_only_substituted_characters(tmp_path):
    # Two invalid sequences become U+FFFD; the U+FFFD already in the file is text, not a replacement.
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 \xff\xfe ok \xef\xbf\xbd end")
    (tmp_path / "b.txt").write_text("a clean second file")
    manifest = build(tmp_path, [{"uri": uri(tmp_path / "*.txt")}], val_fraction=0.5)
    assert "caf\ufffd \ufffd\ufffd ok \ufffd end" in written(tmp_path / "out")
    assert manifest["replaced_chars"] == 3  # \xe9, \xff, \xfe: one U+FFFD each


def test_strict_encoding_names_file_and_byte_offset(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello \xff world")
    with pytest.raises(CorpusError, match=r"a\.txt .*invalid UTF-8 at byte offset 6"):
        build(tmp_path, [{"uri": uri(tmp_path / "a.txt")}], encoding_errors="strict")
    # In jsonl the offset counts from the start of the (decompressed) file, not of the line.
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n{"text": "bad \xc3("}\n'))
    with pytest.raises(CorpusError, match=r"d\.jsonl\.gz.* line 2: invalid UTF-8 at byte offset 29"):
        build(tmp_path, [{"uri": uri(tmp_path / "d.jsonl.gz")}], encoding_errors="strict")


def test_lone_surrogate_escape_is_an_encoding_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine text"}\n{"text": "half a pair \\ud83d here"}\n')
    with pytest.raises(CorpusError, match=r"d\.jsonl document index 1: lone surrogate '\\ud83d' at character 12"):
        build(tmp_path, [{"uri": uri(path)}], encoding_errors="strict")
    manifest = build(tmp_path, [{"uri": uri(path)}], val_fraction=0.5)
    assert "half a pair \ufffd here" in written(tmp_path / "out")
    assert manifest["replaced_chars"] == 1


@pytest.mark.parametrize("text", ["plain ascii", 'quotes " and \\ backslash', "tab\tcr\rlf\nff\fbs\b",
                                  "controls \x01\x1f\x7f", "non-ascii é 中 😀 \u2028", ""])
def test_jsonl_line_is_one_compact_json_object_per_line(text):
    line = jsonl_line(text)
    assert line == (json.dumps({"text": text}, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    assert line.count(b"\n") == 1 and json.loads(line) == {"text": text}


# ----------------------------------------------------------------------------------------------- split and cap


def test_split_is_by_content_hash_and_stable_when_a_source_is_appended(tmp_path):
    first = [{"text": f"first source document {i}"} for i in range(300)]
    second = [{"text": f"second source document {i}"} for i in range(300)]
    a, b = write_jsonl(tmp_path / "a.jsonl", first), write_jsonl(tmp_path / "b.jsonl", second)
    build(tmp_path, [{"uri": uri(a)}], out="one", val_fraction=0.2)
    build(tmp_path, [{"uri": uri(a)}, {"uri": uri(b)}], out="two", val_fraction=0.2)
    val_one, val_two = set(read_split(tmp_path / "one", "val")), set(read_split(tmp_path / "two", "val"))
    train_one, train_two = set(read_split(tmp_path / "one", "train")), set(read_split(tmp_path / "two", "train"))
    assert 30 < len(val_one) < 90  # ~60 expected: a real split, not a degenerate one
    assert val_one <= val_two and train_one <= train_two
    assert {t for t in val_two if t.startswith("second")}  # the appended source contributes to val too
    assert all(is_val(text, 0.2) for text in val_two) and not any(is_val(text, 0.2) for text in train_two)


def test_documents_keep_input_order_within_a_split(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    build(tmp_path, [{"uri": uri(path)}], val_fraction=0.3)
    for split in ("train", "val"):
        texts = read_split(tmp_path / "out", split)
        assert texts == [d for d in DOCS if d in set(texts)]


def test_max_bytes_keeps_a_deterministic_prefix(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    cap = 1500
    expected, used = [], 0
    for doc in DOCS:  # the documented rule: stop at the first document that does not fit
        if used + len(doc.encode()) > cap:
            break
        expected.append(doc)
        used += len(doc.encode())
    one = build(tmp_path, [{"uri": uri(path)}], out="one", max_bytes=cap)
    two = build(tmp_path, [{"uri": uri(path)}], out="two", max_bytes=cap)
    assert sorted(written(tmp_path / "one")) == sorted(expected)
    assert one["bytes"] == used <= cap
    cut_at = {"source": uri(path), "document_index": len(expected)}
    assert {key: one["cap"][key] for key in ("max_bytes", "reached", "cut_at")} == {
        "max_bytes": cap, "reached": True, "cut_at": cut_at}
    # reading stopped at the document that crossed the cap: the rest was never read
    assert one["dropped"]["over_cap"] == 1 and one["documents_in"] == len(expected) + 1
    assert "never read" in one["cap"]["unread"] and one["sources"][0]["details"]["stopped_at_cap"] is True
    assert (one["train"]["sha256"], one["val"]["sha256"]) == (two["train"]["sha256"], two["val"]["sha256"])


def test_the_cap_reads_only_the_files_and_documents_it_needs(tmp_path):
    """Ten files of 100 documents in a glob, a cap inside the second: the third file on is never opened (nor
    hashed), and the documents read are those kept plus the one that crossed the cap."""
    (tmp_path / "many").mkdir()
    texts = [f"file {number} document {i} " + "x" * 80 for number in range(10) for i in range(100)]
    for number in range(10):
        write_jsonl(tmp_path / "many" / f"{number:02d}.jsonl", [{"text": t} for t in texts[100 * number:][:100]])
    manifest = build(tmp_path, [{"uri": uri(tmp_path / "many" / "*.jsonl")}], max_bytes=150 * 100)
    details = manifest["sources"][0]["details"]
    assert details["files"] == 10 and details["files_read"] == 2 and len(details["file_sha256"]) == 2
    assert details["stopped_at_cap"] is True and manifest["cap"]["reached"]
    read = manifest["documents_in"]
    assert read == manifest["documents"] + 1 < 200
    assert manifest["bytes_in"] == sum(len(text) for text in texts[:read]), "what was read, not the unread rest"
    # a source read to its end is not marked; one the cap stopped is
    uncapped = build(tmp_path, [{"uri": uri(tmp_path / "many" / "00.jsonl")}], out="uncapped")
    assert "stopped_at_cap" not in uncapped["sources"][0]["details"] and uncapped["documents_in"] == 100


def test_empty_val_gets_the_document_nearest_the_boundary(tmp_path):
    docs = [f"small corpus document {i}" for i in range(5)]
    assert not any(is_val(d, 0.01) for d in docs)  # the premise: by hash alone val would be empty
    manifest = build(tmp_path, [{"uri": uri(write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs]))}],
                     val_fraction=0.01)
    nearest = min(docs, key=lambda d: hashlib.sha256(d.encode()).digest()[:8])
    assert read_split(tmp_path / "out", "val") == [nearest]
    assert read_split(tmp_path / "out", "train") == [d for d in docs if d != nearest]
    assert manifest["split"]["fallback"]["moved"] == "train->val"
    assert (manifest["train"]["documents"], manifest["val"]["documents"]) == (4, 1)
    assert manifest["val"]["bytes"] == len(nearest.encode())
    assert manifest["train"]["sha256"] == sha256_file(tmp_path / "out" / "train.jsonl")


def test_empty_result_fails_before_writing_and_says_what_was_dropped(tmp_path):
    docs = ["a long enough document", "a long enough document", "tiny", "another long document"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    with pytest.raises(CorpusError, match=r"no training text after cleaning.*1 documents read.*"
                                          r"'too_short': 0, 'duplicate': 0, 'over_cap': 1"):
        build(tmp_path, [{"uri": uri(path)}], min_chars=10, max_bytes=5)
    assert list((tmp_path / "out").iterdir()) == []
    with pytest.raises(CorpusError, match="only 1 document left"):
        build(tmp_path, [{"uri": uri(path)}], min_chars=10, max_bytes=30)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_failed_build_leaves_the_previous_outputs_whole(tmp_path):
    good = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    before = build(tmp_path, [{"uri": uri(good)}])
    snapshot = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    # The second source fails after the first was fully cleaned and written to the temporary files.
    with pytest.raises(CorpusError, match="no such file"):
        build(tmp_path, [{"uri": uri(good)}, {"uri": uri(tmp_path / "gone.jsonl")}], dedup=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == snapshot
    assert before["train"]["sha256"] == sha256_file(tmp_path / "out" / "train.jsonl")


def test_manifest_describes_the_files(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    manifest = build(tmp_path, [{"uri": uri(path)}], min_chars=3)
    out = tmp_path / "out"
    assert json.loads((out / "manifest.json").read_text()) == manifest
    for split in ("train", "val"):
        texts = read_split(out, split)
        assert manifest[split]["documents"] == len(texts) > 0
        assert manifest[split]["bytes"] == sum(len(t.encode()) for t in texts)
        assert manifest[split]["sha256"] == sha256_file(out / f"{split}.jsonl")
    assert manifest["documents"] == len(DOCS)
    assert manifest["settings"] == {**DEFAULTS, "min_chars": 3}
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train.jsonl", "val.jsonl"]


def test_manifest_records_the_sha256_of_every_local_file(tmp_path):
    single = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    (tmp_path / "parts").mkdir()
    for number in range(3):
        (tmp_path / "parts" / f"{number}.txt.gz").write_bytes(gzip.compress(f"part {number} text".encode()))
    pattern = str(tmp_path / "parts" / "*.txt.gz")
    manifest = build(tmp_path, [{"uri": uri(single)}, {"uri": f"file://{pattern}"}])
    one, glob_source = manifest["sources"]
    assert one["sha256"] == sha256_file(single) and one["details"]["file_sha256"] == {str(single): one["sha256"]}
    files = sorted((tmp_path / "parts").iterdir())
    # each file as it is on disk (compressed), and the glob's digest over sha256sum's listing of them
    assert glob_source["details"]["file_sha256"] == {str(f): sha256_file(f) for f in files}
    listing = "".join(f"{sha256_file(f)}  {f}\n" for f in files)
    assert glob_source["sha256"] == hashlib.sha256(listing.encode()).hexdigest()
    # the same bytes rewritten the same size: another digest
    (tmp_path / "parts" / "1.txt.gz").write_bytes(gzip.compress(b"part 9 text"))
    again = build(tmp_path, [{"uri": uri(single)}, {"uri": f"file://{pattern}"}], out="out2")["sources"][1]
    assert again["sha256"] != glob_source["sha256"]
    assert again["details"]["file_sha256"][str(files[1])] != glob_source["details"]["file_sha256"][str(files[1])]


def test_local_source_files_lists_what_the_workflow_declares_as_inputs(tmp_path):
    from pretrain_bench.data.sources import local_source_files

    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "a.txt").write_text("a")
    sources = [{"uri": "builtin://python-stdlib"}, {"uri": uri(tmp_path / "*.txt")}, {"uri": uri(tmp_path / "b.txt")}]
    assert local_source_files(sources) == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), str(tmp_path / "b.txt")]
    with pytest.raises(CorpusError, match="the glob matched no files"):
        local_source_files([{"uri": uri(tmp_path / "*.jsonl")}])


# ------------------------------------------------------------------------------------------ builtin and hf://


def test_builtin_stdlib_is_nonempty_deterministic_and_real(tmp_path):
    one = build(tmp_path, [{"uri": "builtin://python-stdlib"}], out="one", val_fraction=0.02)
    two = build(tmp_path, [{"uri": "builtin://python-stdlib"}], out="two", val_fraction=0.02)
    assert one["train"]["sha256"] == two["train"]["sha256"] and one["val"]["sha256"] == two["val"]["sha256"]
    assert one["documents"] > 300 and one["val"]["documents"] > 0 and one["bytes"] > 3_000_000
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = set(written(tmp_path / "one"))
    assert (stdlib / "textwrap.py").read_text("utf-8") in texts
    assert one["sources"][0]["details"]["root"] == str(stdlib)


def test_builtin_stdlib_capped_like_the_tiny_run(tmp_path):
    manifest = build(tmp_path, [{"uri": "builtin://python-stdlib"}], max_bytes=4_000_000, val_fraction=0.02)
    assert 3_500_000 < manifest["bytes"] <= 4_000_000
    assert manifest["val"]["documents"] > 0 and manifest["dropped"]["over_cap"] > 0


def test_hf_offline_without_cache_fails_fast_with_the_download_command(tmp_path):
    script = textwrap.dedent(f"""
        from pathlib import Path
        from pretrain_bench.data.corpus import CorpusError, build_corpus
        try:
            build_corpus([{{"uri": "hf://Salesforce/wikitext", "config": "wikitext-2-raw-v1", "split": "train"}}],
                         Path({str(tmp_path / "out")!r}), max_bytes=None, min_chars=1, dedup=True,
                         val_fraction=0.01, encoding_errors="replace", cache_dir=Path("resources/corpus-cache"))
        except CorpusError as error:
            print(error)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    message = result.stdout
    assert "hf://Salesforce/wikitext" in message and "offline mode is on" in message
    assert ("HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 python -c \"import datasets; datasets.load_dataset("
            "'Salesforce/wikitext', 'wikitext-2-raw-v1', split='train', cache_dir='resources/corpus-cache/hf')\""
            ) in message
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_hf_source_reads_a_local_dataset(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "ds").mkdir()
    write_jsonl(tmp_path / "ds" / "train.jsonl", [{"content": d, "n": i} for i, d in enumerate(DOCS)])
    source = {"uri": f"hf://{tmp_path / 'ds'}", "split": "train", "text_field": "content"}
    manifest = build(tmp_path, [source])
    assert sorted(written(tmp_path / "out")) == sorted(DOCS)
    assert manifest["sources"][0]["details"]["rows"] == len(DOCS)
    # what datasets resolved the source to (a Hub commit; for a local folder, datasets' hash of its files)
    assert manifest["sources"][0]["details"]["resolved_revision"]
    with pytest.raises(CorpusError, match=r"no column 'text'.*'content'"):
        build(tmp_path, [{**source, "text_field": "text"}], out="out2")


# ---------------------------------------------------------------------------------------- script and rule


def load_script():
    spec = importlib.util.spec_from_file_location("download_corpus", ROOT / "workflow_scripts" / "download_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_main_logs_success_and_failure(tmp_path):
    main = load_script().main
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    cache = str(tmp_path / "cache")
    manifest = main(str(tmp_path / "ok.log"), str(tmp_path / "out"), {"sources": [{"uri": uri(path)}], **DEFAULTS},
                    cache)
    assert manifest["documents"] == len(DOCS)
    assert f"corpus: {len(DOCS)} documents" in (tmp_path / "ok.log").read_text()
    with pytest.raises(CorpusError):
        main(str(tmp_path / "bad.log"), str(tmp_path / "out2"), {"sources": [{"uri": uri(tmp_path / "x.txt")}],
                                                                   **DEFAULTS}, cache)
    assert "download_corpus failed" in (tmp_path / "bad.log").read_text()


def test_a_job_waits_for_another_pipeline_building_the_same_product_then_uses_it(tmp_path):
    log = tmp_path / "logs" / "download_corpus.log"  # both pipelines' job, in one working directory (--nolock)
    log.parent.mkdir()
    out = tmp_path / "out"
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    corpus, cache = {"sources": [{"uri": uri(path)}], **DEFAULTS}, str(tmp_path / "cache")
    script = ROOT / "workflow_scripts" / "download_corpus.py"
    load = (f"import importlib.util, json, sys\nspec = importlib.util.spec_from_file_location('dc', {str(script)!r})\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n")
    # the first pipeline's job: takes the product's lock, then builds only once told to
    holder = subprocess.Popen([sys.executable, "-c", load + textwrap.dedent(f"""
        build = module.build_corpus
        def told_to_build(**settings):
            print("holding", flush=True)
            sys.stdin.readline()
            return build(**settings)
        module.build_corpus = told_to_build
        module.main({str(log)!r}, {str(out)!r}, {corpus!r}, {cache!r})
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        waiter = subprocess.Popen([sys.executable, "-c", load + textwrap.dedent(f"""
            print(json.dumps(module.main({str(log)!r}, {str(out)!r}, {corpus!r}, {cache!r})))
        """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # the second says whom it waits for, on its terminal and in its log, and writes nothing meanwhile
        lines = iter(waiter.stderr.readline, "")
        waiting = next((line for line in lines if line.startswith("download_corpus: waiting")), None)
        assert waiting.startswith(f"download_corpus: waiting for pid {holder.pid} building {out}/train.jsonl"), \
            waiting
        assert not [path.name for path in out.glob("*") if path.suffix != ".lock"], "nothing written meanwhile"
        holder.communicate("go\n", timeout=120)
        stdout, stderr = waiter.communicate(timeout=120)
    finally:
        holder.kill()
    assert holder.returncode == 0 and waiter.returncode == 0, stderr
    built = {name: (out / name).stat().st_mtime_ns for name in ("train.jsonl", "val.jsonl", "manifest.json")}
    # the second used the finished product (its manifest), built nothing again
    assert json.loads(stdout)["documents"] == len(DOCS)
    assert {name: (out / name).stat().st_mtime_ns for name in built} == built
    attempts = sorted(log.with_name("download_corpus.attempts").glob("*.log"))
    assert len(attempts) == 2  # each job's log kept
    waited = next(path.read_text() for path in attempts if "waiting for pid" in path.read_text())
    assert f"pid {holder.pid} finished building" in waited and "using it" in waited


def test_a_data_jobs_log_leaves_no_temporary_name_behind(tmp_path):
    """stage_job_log points the declared log at the attempt's file when the job starts and again when it ends; the
    second time the name is already that file's, and rename() between two names of one file does nothing (POSIX),
    which used to leave `<job>.log.<pid>.tmp` behind after every data job."""
    import logging

    from pretrain_bench.train.state_lock import stage_job_log

    log = tmp_path / "logs" / "shard_tokens.log"
    for attempt in range(2):
        with stage_job_log(str(log), "shard_tokens"):
            logging.getLogger("pretrain_bench").info("attempt %d", attempt)
    assert sorted(path.name for path in log.parent.iterdir()) == ["shard_tokens.attempts", "shard_tokens.log"]
    assert "attempt 1" in log.read_text()


def corpus_workflow(folder: Path, sources_yaml: str):
    """A Snakefile in `folder` with rule download_corpus alone (and the config it reads); returns a runner of
    `snakemake ARGS` there."""
    (folder / "config.yaml").write_text(f"name: t\ncorpus:\n  sources:\n{sources_yaml}  max_bytes: 300000\n")
    (folder / "Snakefile").write_text(textwrap.dedent(f"""
        from pretrain_bench.config.schema import (CorpusSettings, ShardSettings, TokenizerSettings,
                                                 fill_defaults_and_validate, load_schema)
        from pretrain_bench.data.sources import local_source_files
        from pretrain_bench.data.products import DataProducts
        configfile: "config.yaml"
        # the corpus block validated, which fills in the defaults the rule reads (the Snakefile does this for all)
        fill_defaults_and_validate(config["corpus"],
                                   load_schema("{ROOT / 'schemas' / 'config.schema.yaml'}")["properties"]["corpus"])
        CORPUS = CorpusSettings.from_config(config["corpus"])  # as rules/common.smk sets them
        CORPUS_FILES = local_source_files(CORPUS.sources)
        DATA = DataProducts.from_settings(CORPUS, TokenizerSettings(), ShardSettings(), None)
        include: "{ROOT / 'rules' / 'corpus.smk'}"
        rule all:
            input: DATA.manifest
    """))
    snakemake = str(Path(sys.executable).parent / "snakemake")

    def run(*args):
        result = subprocess.run([snakemake, "--cores", "1", *args], cwd=folder, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr
    return run


needs_snakemake = pytest.mark.skipif(shutil.which("snakemake", path=str(Path(sys.executable).parent)) is None,
                                     reason="snakemake not installed in this environment")


@needs_snakemake
def test_rule_runs_under_snakemake(tmp_path):
    corpus_workflow(tmp_path, "    - uri: builtin://python-stdlib\n")("--quiet")
    (corpus,) = (tmp_path / "results").glob("data/corpus-*")  # the corpus lives under its data id
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert 0 < manifest["bytes"] <= 300000 and manifest["settings"]["val_fraction"] == 0.01
    relative = corpus.relative_to(tmp_path / "results")
    assert "corpus:" in (tmp_path / "logs" / relative / "download_corpus.log").read_text()
    assert (tmp_path / "benchmarks" / relative / "download_corpus.tsv").exists()


@needs_snakemake
def test_a_new_file_matching_a_source_glob_rebuilds_the_corpus(tmp_path):
    (tmp_path / "texts").mkdir()
    for number in range(2):
        (tmp_path / "texts" / f"{number}.txt").write_text(f"the text of file {number}, long enough to keep")
    run = corpus_workflow(tmp_path, "    - uri: file://texts/*.txt\n")  # relative to the working directory
    run("--quiet")
    assert "Nothing to be done" in run("-n")
    (tmp_path / "texts" / "2.txt").write_text("a third file, added after the corpus was built")
    run("--quiet")  # rebuilds: the manifest below counts the third file
    (manifest_path,) = (tmp_path / "results").glob("data/corpus-*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    assert manifest["documents"] == 3 and sorted(manifest["sources"][0]["details"]["file_sha256"]) == [
        "texts/0.txt", "texts/1.txt", "texts/2.txt"]
    assert "Nothing to be done" in run("-n")


@pytest.mark.parametrize("pattern", ["results/data/*/train.jsonl", "**/*.jsonl", "results/data/corpus-x/train.jsonl",
                                     "elsewhere/../results/data/corpus-x/train.jsonl"])
def test_a_source_under_results_is_refused_naming_it(tmp_path, monkeypatch, pattern):
    """The pipeline's own outputs as a source: the corpus would be an input of itself, deleted and rebuilt by the
    next run with its source inside it. Refused when the workflow is parsed (local_source_files), naming the source."""
    from pretrain_bench.data.sources import local_source_files

    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "data" / "corpus-x").mkdir(parents=True)
    write_jsonl(tmp_path / "results" / "data" / "corpus-x" / "train.jsonl", [{"text": d} for d in DOCS])
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(CorpusError) as caught:
        local_source_files([{"uri": f"file://{pattern}"}])
    assert str(caught.value).startswith(f"file://{pattern}: ") and "is under results/" in str(caught.value)
    (tmp_path / "mine").mkdir()
    write_jsonl(tmp_path / "mine" / "a.jsonl", [{"text": d} for d in DOCS])
    assert local_source_files([{"uri": "file://mine/*.jsonl"}]) == ["mine/a.jsonl"]


def test_snakemakes_lock_refusal_is_explained_where_another_snakemake_holds_the_directory(tmp_path):
    from pretrain_bench.train.state_lock import snakemake_lock_note

    locks = tmp_path / ".snakemake" / "locks"
    assert snakemake_lock_note(locks, ["snakemake", "--cores", "2"]) is None
    locks.mkdir(parents=True)
    (locks / "0.output.lock").write_text("results/data/corpus-a/train.jsonl\n")
    note = snakemake_lock_note(locks, ["snakemake", "--cores", "2"])
    assert "add --nolock, which is safe here: each data product has its own lock" in note
    assert "snakemake --unlock" in note
    assert snakemake_lock_note(locks, ["snakemake", "--nolock"]) is None
    assert snakemake_lock_note(locks, ["snakemake", "-n"]) is None
