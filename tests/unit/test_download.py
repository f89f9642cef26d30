"""pretrain_bench.data.download against a local fault-injecting HTTP server (httpfixture.py); no internet needed."""
import gzip
import hashlib
import json
import socket
from pathlib import Path

import pytest

from httpfixture import FixtureServer, Route
from pretrain_bench.data.corpus import CorpusError, build_corpus
from pretrain_bench.data.download import DownloadError, download, http_validators

# ~1 MiB of non-repeating bytes: several 64 KiB stream chunks arrive before an injected drop at the halfway mark.
BODY = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(32768))
BODY_SHA = hashlib.sha256(BODY).hexdigest()
FAST = {"backoff_s": 0.01, "connect_timeout_s": 2, "read_timeout_s": 5}


def leftovers(folder: Path) -> list[str]:
    """Files a download left besides the final one and its lock file."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def test_plain_download_is_verified_and_atomic(tmp_path):
    with FixtureServer({"/data.bin": Route(BODY)}) as server:
        digest = download(server.url("/data.bin"), tmp_path / "data.bin", sha256=BODY_SHA.upper(), **FAST)
    assert digest == BODY_SHA
    assert (tmp_path / "data.bin").read_bytes() == BODY
    assert leftovers(tmp_path) == ["data.bin", "data.bin.http.json"]  # the file and its validators
    assert server.requests == [("/data.bin", None)]


def test_dropped_connection_resumes_with_range(tmp_path):
    with FixtureServer({"/data.bin": Route(BODY, drop_first=True)}) as server:
        digest = download(server.url("/data.bin"), tmp_path / "data.bin", sha256=BODY_SHA, **FAST)
    assert digest == BODY_SHA
    assert (tmp_path / "data.bin").read_bytes() == BODY
    assert len(server.requests) == 2
    first, second = server.requests
    assert first == ("/data.bin", None)
    resumed_from = int(second[1].removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_from <= len(BODY) // 2  # resumed, not restarted, and not past what was sent
    assert leftovers(tmp_path) == ["data.bin", "data.bin.http.json"]


def test_server_error_is_retried(tmp_path):
    with FixtureServer({"/data.bin": Route(BODY, fail_first=1)}) as server:
        download(server.url("/data.bin"), tmp_path / "data.bin", **FAST)
    assert (tmp_path / "data.bin").read_bytes() == BODY
    assert len(server.requests) == 2


def test_ignored_range_restarts_from_zero(tmp_path):
    # The first response drops mid-body; the server then ignores Range and sends 200 with the whole body.
    # Appending that to the .part would double its first half; the right outcome is a restart from zero.
    with FixtureServer({"/data.bin": Route(BODY, drop_first=True, ignore_range=True)}) as server:
        digest = download(server.url("/data.bin"), tmp_path / "data.bin", **FAST)
    assert server.requests[1][1] is not None and server.requests[1][1].startswith("bytes=")
    assert (tmp_path / "data.bin").read_bytes() == BODY
    assert digest == BODY_SHA


def test_sha256_mismatch_names_url_and_digests_and_keeps_nothing(tmp_path):
    wrong = hashlib.sha256(b"something else").hexdigest()
    with FixtureServer({"/data.bin": Route(BODY)}) as server:
        url = server.url("/data.bin")
        with pytest.raises(DownloadError) as caught:
            download(url, tmp_path / "data.bin", sha256=wrong, **FAST)
    message = str(caught.value)
    assert url in message and wrong in message and BODY_SHA in message
    assert leftovers(tmp_path) == []


def test_not_found_fails_at_once(tmp_path):
    with FixtureServer({}) as server:
        url = server.url("/missing.txt")
        with pytest.raises(DownloadError, match="404") as caught:
            download(url, tmp_path / "missing.txt", retries=5, backoff_s=10)  # a retry would take 10 s
    assert url in str(caught.value)
    assert len(server.requests) == 1
    assert leftovers(tmp_path) == []


def test_persistent_server_error_gives_up_after_retries(tmp_path):
    with FixtureServer({"/data.bin": Route(BODY, fail_first=1000)}) as server:
        with pytest.raises(DownloadError, match=r"giving up after 3 attempts.*500"):
            download(server.url("/data.bin"), tmp_path / "data.bin", retries=2, **{**FAST, "backoff_s": 0.001})
    assert len(server.requests) == 3
    assert leftovers(tmp_path) == []


def test_read_timeout_is_retried(tmp_path):
    with FixtureServer({"/data.bin": Route(BODY, stall_first=1.5)}) as server:
        download(server.url("/data.bin"), tmp_path / "data.bin", **{**FAST, "read_timeout_s": 0.3})
    assert (tmp_path / "data.bin").read_bytes() == BODY
    assert len(server.requests) == 2


def test_connection_refused_gives_up(tmp_path):
    with socket.socket() as probe:  # a port that nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(DownloadError, match="giving up after 2 attempts"):
        download(f"http://127.0.0.1:{port}/x.txt", tmp_path / "x.txt", retries=1, **FAST)
    assert leftovers(tmp_path) == []


def test_complete_part_left_by_a_crash_is_finished_not_refetched(tmp_path):
    # A crash between the last byte and the rename leaves a complete .part; the server answers 416 to its Range.
    (tmp_path / "data.bin.part").write_bytes(BODY)
    with FixtureServer({"/data.bin": Route(BODY)}) as server:
        digest = download(server.url("/data.bin"), tmp_path / "data.bin", sha256=BODY_SHA, **FAST)
    assert digest == BODY_SHA
    assert server.requests == [("/data.bin", f"bytes={len(BODY)}-")]
    assert leftovers(tmp_path) == ["data.bin"]


def test_cached_file_is_reused_only_when_it_matches(tmp_path):
    dest = tmp_path / "data.bin"
    with FixtureServer({"/data.bin": Route(BODY)}) as server:
        download(server.url("/data.bin"), dest, sha256=BODY_SHA, **FAST)
        download(server.url("/data.bin"), dest, sha256=BODY_SHA, **FAST)
        assert len(server.requests) == 1  # second call: cache hit
        dest.write_bytes(b"corrupted")
        download(server.url("/data.bin"), dest, sha256=BODY_SHA, **FAST)
        assert len(server.requests) == 2  # corrupted cache: fetched again
    assert dest.read_bytes() == BODY


ETAG, LAST_MODIFIED = '"v1-5f3a"', "Tue, 01 Dec 2026 10:00:00 GMT"


def test_server_validators_are_kept_with_the_file_and_its_cache_hits(tmp_path):
    dest = tmp_path / "data.bin"
    with FixtureServer({"/data.bin": Route(BODY, etag=ETAG, last_modified=LAST_MODIFIED)}) as server:
        download(server.url("/data.bin"), dest, **FAST)
        assert http_validators(dest) == {"etag": ETAG, "last_modified": LAST_MODIFIED}
        download(server.url("/data.bin"), dest, **FAST)  # cache hit: no request, same validators
        assert len(server.requests) == 1
    assert http_validators(dest) == {"etag": ETAG, "last_modified": LAST_MODIFIED}
    with FixtureServer({"/other.bin": Route(BODY)}) as server:  # a server that sends none
        download(server.url("/other.bin"), tmp_path / "other.bin", **FAST)
    assert http_validators(tmp_path / "other.bin") == {"etag": None, "last_modified": None}


def test_resume_carries_if_range_and_a_file_changed_meanwhile_is_fetched_whole(tmp_path):
    new_body = BODY[::-1]  # the same size: only the validator tells the two versions apart
    route = Route(BODY, etag=ETAG, drop_first=True, changed_body=new_body, changed_etag='"v2-77c1"')
    with FixtureServer({"/data.bin": route}) as server:
        digest = download(server.url("/data.bin"), tmp_path / "data.bin", **FAST)
    assert route.if_ranges == [None, ETAG]  # the resume asked for the rest of version 1 only
    assert server.requests[1][1] is not None, "it did try to resume"
    # not BODY's first half spliced onto new_body's second half
    assert (tmp_path / "data.bin").read_bytes() == new_body and digest == hashlib.sha256(new_body).hexdigest()
    assert http_validators(tmp_path / "data.bin")["etag"] == '"v2-77c1"'


def test_resume_of_an_unchanged_file_continues_with_if_range(tmp_path):
    route = Route(BODY, etag=ETAG, drop_first=True)
    with FixtureServer({"/data.bin": route}) as server:
        download(server.url("/data.bin"), tmp_path / "data.bin", sha256=BODY_SHA, **FAST)
    assert route.if_ranges == [None, ETAG] and server.requests[1][1] != "bytes=0-"
    assert (tmp_path / "data.bin").read_bytes() == BODY


# ---------------------------------------------------------------- http(s) sources through build_corpus


def jsonl_gz(texts: list[str]) -> bytes:
    return gzip.compress("".join(json.dumps({"body": text}) + "\n" for text in texts).encode())


SETTINGS = {"max_bytes": None, "min_chars": 1, "dedup": True, "val_fraction": 0.5, "encoding_errors": "strict"}


def test_http_source_is_parsed_like_a_file(tmp_path):
    texts = [f"document number {i}" for i in range(20)]
    payload = jsonl_gz(texts)
    # The query string must not confuse the format detection (by the URL path's extension).
    with FixtureServer({"/dump/part-0.jsonl.gz?version=1": Route(payload)}) as server:
        url = server.url("/dump/part-0.jsonl.gz?version=1")
        source = {"uri": url, "sha256": hashlib.sha256(payload).hexdigest(), "text_field": "body"}
        manifest = build_corpus([source], tmp_path / "out", cache_dir=tmp_path / "cache", **SETTINGS)
    written = [json.loads(line)["text"] for split in ("train", "val")
               for line in (tmp_path / "out" / f"{split}.jsonl").read_text().splitlines()]
    assert sorted(written) == sorted(texts)
    assert manifest["sources"][0]["sha256"] == hashlib.sha256(payload).hexdigest()
    assert manifest["sources"][0]["kind"] == "http"


def test_manifest_records_the_http_validators_of_the_source(tmp_path):
    payload = jsonl_gz(["a document", "another document", "a third one"])
    with FixtureServer({"/d.jsonl.gz": Route(payload, etag=ETAG, last_modified=LAST_MODIFIED)}) as server:
        manifest = build_corpus([{"uri": server.url("/d.jsonl.gz"), "text_field": "body"}], tmp_path / "out",
                                cache_dir=tmp_path / "cache", **SETTINGS)
    source = manifest["sources"][0]
    assert source["sha256"] == hashlib.sha256(payload).hexdigest()
    assert source["details"]["etag"] == ETAG and source["details"]["last_modified"] == LAST_MODIFIED


def test_http_checksum_mismatch_fails_the_build_without_outputs(tmp_path):
    payload = jsonl_gz(["a document", "another document"])
    wrong = "0" * 64
    with FixtureServer({"/d.jsonl.gz": Route(payload)}) as server:
        url = server.url("/d.jsonl.gz")
        with pytest.raises(CorpusError) as caught:
            build_corpus([{"uri": url, "sha256": wrong, "text_field": "body"}], tmp_path / "out",
                         cache_dir=tmp_path / "cache", **SETTINGS)
    assert url in str(caught.value) and wrong in str(caught.value)
    assert hashlib.sha256(payload).hexdigest() in str(caught.value)
    assert list((tmp_path / "out").iterdir()) == []
    assert leftovers(tmp_path / "cache" / "http") == []


def test_http_file_of_any_other_name_is_one_text_document_and_a_binary_one_is_skipped(tmp_path):
    routes = {"/page.html": Route(b"<html><p>hello</p></html>"), "/notes.md": Route(b"# notes\n\ntext"),
              "/logo.png": Route(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(256))}
    with FixtureServer(routes) as server:
        manifest = build_corpus([{"uri": server.url(path)} for path in routes], tmp_path / "out",
                                cache_dir=tmp_path / "c", **SETTINGS)
    assert manifest["documents"] == 2 and manifest["binary_skipped"] == 1
    assert [source["binary_skipped"] for source in manifest["sources"]] == [0, 0, 1]
