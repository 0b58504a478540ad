"""What the chaos soak reads from its logs (``kvbridge.tools.bench.soak_logs``): tracebacks,
warnings after start-up folded and counted, and the lines that name a request. Files only."""

from __future__ import annotations

from pathlib import Path

from kvbridge.tools.bench.soak_logs import fold, lines_of, tracebacks, warnings

P1 = """\
(APIServer pid=1) WARNING 12-06 05:35:42 [system_utils.py:255] Found ulimit of 20000
(APIServer pid=1) INFO 12-06 05:36:24 [launcher.py:46] Application startup complete.
(Worker pid=3834) WARNING 12-06 05:39:41 [base_worker.py:3032] Releasing expired KV blocks for \
request cmpl-soak-s5-212-0-a9974458 which were retrieved by 0 remote worker(s) before lease expired.
(Worker pid=3834) WARNING 12-06 05:39:42 [base_worker.py:3032] Releasing expired KV blocks for \
request cmpl-soak-s5-21-0-b339e009 which were retrieved by 0 remote worker(s) before lease expired.
(Worker pid=3834) ERROR 12-06 05:40:30 [pull_worker.py:667] Potentially invalid KV blocks for \
unrecognized request cmpl-soak-s5-212-0-a9974458 were retrieved by a decode worker.
(APIServer pid=1) ERROR 12-06 05:41:41 [async_llm.py:906] Traceback (most recent call last):
(APIServer pid=1) ERROR 12-06 05:41:41 [async_llm.py:906]   File "x.py", line 849, in handler
(APIServer pid=1) ERROR 12-06 05:41:41 [async_llm.py:906] vllm.v1.engine.exceptions.\
EngineDeadError: EngineCore encountered an issue.
"""


def _logs(tmp_path: Path) -> Path:
    (tmp_path / "P1-1.log").write_text(P1)
    (tmp_path / "D0-2.log").write_text("(APIServer pid=2) INFO 12-06 [x.py:1] all fine\n")
    (tmp_path / "proxy-3.log").write_text(
        "2026-12-06 05:39:41,083 WARNING kvbridge.proxy: soak-s5-212 pull failed (x)\n")
    return tmp_path


def test_warnings_after_start_up_are_folded_and_counted_per_engine_log(tmp_path: Path) -> None:
    found = warnings(_logs(tmp_path))
    # D0 said nothing; the proxy's log is not an engine's
    assert [Path(e["log"]).name for e in found] == ["P1-1.log"]
    lines = found[0]["lines"]
    assert lines[0] == {"level": "WARNING", "count": 2, "message": fold(
        "Releasing expired KV blocks for request cmpl-soak-s5-212-0-a9974458 which were "
        "retrieved by 0 remote worker(s) before lease expired.")}
    assert "request # which" in lines[0]["message"]
    assert any(x["level"] == "ERROR" and x["message"].startswith("Potentially invalid KV blocks")
               for x in lines)
    assert not any("ulimit" in x["message"] for x in lines)  # start-up's, not the run's
    assert not any(x["message"].startswith(("Traceback", "File")) for x in lines)


def test_tracebacks_name_the_log_and_the_last_exception(tmp_path: Path) -> None:
    (found,) = tracebacks(_logs(tmp_path))
    assert found["tracebacks"] == 1 and found["log"].endswith("P1-1.log")
    assert found["last"].startswith("vllm.v1.engine.exceptions.EngineDeadError")


def test_lines_of_a_request_are_found_in_every_log_and_not_those_of_a_longer_id(
        tmp_path: Path) -> None:
    got = lines_of(_logs(tmp_path), ["soak-s5-212", "soak-s5-21", "soak-s5-2"])
    assert [line.split(":")[0] for line in got["soak-s5-212"]] == ["P1-1.log", "P1-1.log",
                                                                    "proxy-3.log"]
    assert len(got["soak-s5-21"]) == 1 and "b339e009" in got["soak-s5-21"][0]
    assert got["soak-s5-2"] == [] and lines_of(tmp_path, []) == {}
