"""The NCCL tuner plugin, compiled with the system C compiler and driven through its exported
structs as NCCL drives them (init, getCollInfo on a cost table we allocate, finalize): every
answer checked against the table, the fall-through, malformed tables, tables for another job
shape, and the node-count keying."""
import ctypes
import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrate.errors import UserError
from kernels.nccl_tuner import table as T
from kernels.nccl_tuner.build import build

NA, NP = len(T.ALGORITHMS), len(T.PROTOCOLS)
LOGGER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_char_p)
INIT5 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64, ctypes.c_size_t,
                         ctypes.c_size_t, LOGGER, ctypes.c_void_p, ctypes.c_void_p)
INIT3 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, LOGGER, ctypes.POINTER(ctypes.c_void_p))
GET5 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
GET3 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                        ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
FIN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class Api(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", ctypes.c_void_p), ("getCollInfo", ctypes.c_void_p),
                ("finalize", ctypes.c_void_p)]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if shutil.which(os.environ.get("CC", "cc")) is None and not os.environ.get("CI"):
        pytest.skip("no C compiler (CI installs gcc)")
    return ctypes.CDLL(str(build(tmp_path_factory.mktemp("tuner") / "libnccl-tuner-commtune.so")))


class Plugin:
    """One communicator's plugin context, through the v5, v4 or v3 struct."""

    def __init__(self, lib, version: int, ranks: int, nodes: int):
        api = Api.in_dll(lib, f"ncclTunerPlugin_v{version}")
        self.version, self.name = version, api.name.decode()
        self.lines: list[tuple[int, str]] = []
        self._logger = LOGGER(lambda level, flags, file, line, fmt, msg: self.lines.append((level, msg.decode())))
        self.ctx = ctypes.c_void_p()
        if version == 5:
            rc = INIT5(api.init)(ctypes.byref(self.ctx), 42, ranks, nodes, self._logger, None, None)
        else:
            rc = INIT3(api.init)(ranks, nodes, self._logger, ctypes.byref(self.ctx))
        assert rc == 0
        self._get = (GET5 if version >= 4 else GET3)(api.getCollInfo)
        self._fin = FIN(api.finalize)

    def ask(self, collective: str, nbytes: int, ignored=(), pipe_ops=1, reg_buff=0):
        """(cost table after the call, nChannels) for a cost table whose entry (a, p) is 10 + 3a + p,
        or -1 (NCCL's 'ignore') for the pairs in ``ignored``."""
        cost = (ctypes.c_float * (NA * NP))()
        for a in range(NA):
            for p in range(NP):
                cost[a * NP + p] = -1.0 if (T.ALGORITHMS[a], T.PROTOCOLS[p]) in ignored else 10.0 + 3 * a + p
        nch = ctypes.c_int(0)
        func = T.COLLECTIVES.index(collective)
        if self.version >= 4:
            rc = self._get(self.ctx, func, nbytes, pipe_ops, ctypes.addressof(cost), NA, NP, reg_buff,
                           ctypes.byref(nch))
        else:
            rc = self._get(self.ctx, func, nbytes, pipe_ops, ctypes.addressof(cost), NA, NP, ctypes.byref(nch))
        assert rc == 0
        return list(cost), nch.value

    def answer(self, collective: str, nbytes: int, ignored=(), **kw):
        """What NCCL would run: the plugin's (algorithm, protocol, channels), or None for NCCL's own choice."""
        cost, nch = self.ask(collective, nbytes, ignored, **kw)
        zeros = [i for i, c in enumerate(cost) if c == 0.0]
        untouched = [-1.0 if (T.ALGORITHMS[i // NP], T.PROTOCOLS[i % NP]) in ignored else 10.0 + 3 * (i // NP) + i % NP
                     for i in range(NA * NP)]
        if not zeros:
            assert cost == untouched and nch == 0, "the plugin changed NCCL's table without choosing"
            return None
        assert len(zeros) == 1
        i = zeros[0]
        assert [c for j, c in enumerate(cost) if j != i] == [c for j, c in enumerate(untouched) if j != i]
        return T.ALGORITHMS[i // NP], T.PROTOCOLS[i % NP], nch if nch else -1

    def close(self):
        assert self._fin(self.ctx) == 0


@pytest.fixture
def plugin(lib, monkeypatch, tmp_path):
    made = []

    def make(text: str | None, ranks=2, nodes=1, version=5):
        if text is None:
            monkeypatch.delenv(T.ENV_TABLE, raising=False)
        else:
            path = tmp_path / f"table{len(made)}.csv"
            path.write_text(text)
            monkeypatch.setenv(T.ENV_TABLE, str(path))
        made.append(Plugin(lib, version, ranks, nodes))
        return made[-1]

    yield make
    for p in made:
        p.close()


TABLE = """# a table of python -m autotune nccl
allreduce,0,1023,ring,ll,-1,1,2
allreduce,1024,65535,tree,ll128,16,1,2
allreduce,65536,18446744073709551615,ring,simple,64,1,2
allgather,4096,8191,ring,ll128,32,1,2
broadcast,0,100,ring,simple,8,-1,-1,4
reducescatter,0,100,ring,ll,2,-1,-1,-1,1
"""


@pytest.mark.parametrize("version", [5, 4, 3])
def test_every_answer_and_the_fall_through(plugin, version):
    p = plugin(TABLE, version=version)
    assert p.name == "commtune"
    assert p.answer("allreduce", 0) == ("ring", "ll", -1)
    assert p.answer("allreduce", 1023) == ("ring", "ll", -1)
    assert p.answer("allreduce", 1024) == ("tree", "ll128", 16)
    assert p.answer("allreduce", 65535) == ("tree", "ll128", 16)
    assert p.answer("allreduce", 1 << 30) == ("ring", "simple", 64)
    assert p.answer("allreduce", T.SIZE_MAX) == ("ring", "simple", 64)
    assert p.answer("allgather", 4096) == ("ring", "ll128", 32)
    assert p.answer("allgather", 4095) is None            # no row: NCCL's choice
    assert p.answer("allgather", 8192) is None
    assert p.answer("reduce", 10) is None                 # no row for the collective
    assert p.answer("broadcast", 50, pipe_ops=4) == ("ring", "simple", 8)
    assert p.answer("broadcast", 50, pipe_ops=1) is None  # numPipeOps keyed
    # regBuff keyed: v3 does not tell, so a row that needs a registered buffer never matches there
    assert p.answer("reducescatter", 50, reg_buff=1) == (None if version == 3 else ("ring", "ll", 2))
    assert p.answer("reducescatter", 50, reg_buff=0) is None
    assert p.lines and "2 ranks on 1 node" in p.lines[0][1]


def test_a_pair_nccl_rules_out_keeps_nccl_choice_and_says_so_once(plugin):
    p = plugin(TABLE)
    assert p.answer("allreduce", 2048, ignored={("tree", "ll128")}) is None
    assert p.answer("allreduce", 4096, ignored={("tree", "ll128")}) is None
    said = [m for _, m in p.lines if "not available" in m]
    assert len(said) == 1 and "line 3" in said[0]
    assert p.answer("allreduce", 2048) == ("tree", "ll128", 16)


def test_counters_of_inits_and_decided_calls(plugin, lib):
    inits, decided = (ctypes.c_ulong.in_dll(lib, n) for n in ("commtune_tuner_inits", "commtune_tuner_decided"))
    i0, d0 = inits.value, decided.value
    p = plugin(TABLE)
    p.answer("allreduce", 10)
    p.answer("allgather", 10)  # no row: not counted
    assert (inits.value - i0, decided.value - d0) == (1, 1)


def test_what_runs_is_noted_nccls_pick_or_the_row(plugin, lib):
    last = {n: (ctypes.c_ulonglong if n == "bytes" else ctypes.c_int).in_dll(lib, f"commtune_tuner_last_{n}")
            for n in ("coll", "bytes", "algo", "proto")}

    def noted():
        return (T.COLLECTIVES[last["coll"].value], last["bytes"].value, T.ALGORITHMS[last["algo"].value],
                T.PROTOCOLS[last["proto"].value])

    p = plugin(TABLE)
    p.answer("allreduce", 2048)
    assert noted() == ("allreduce", 2048, "tree", "ll128")            # the row
    p.answer("allgather", 100)                                         # no row: NCCL's pick, the cheapest entry
    assert noted() == ("allgather", 100, "tree", "ll")
    p.answer("allgather", 100, ignored={("tree", "ll"), ("tree", "ll128")})
    assert noted() == ("allgather", 100, "tree", "simple")
    p.answer("allreduce", 2048, ignored={("tree", "ll128"), ("tree", "ll")})  # row ruled out: NCCL's pick
    assert noted() == ("allreduce", 2048, "tree", "simple")


def test_no_table_keeps_nccl_choice(plugin, capfd):
    p = plugin(None)
    assert p.answer("allreduce", 1 << 20) is None
    assert any("unset" in m for _, m in p.lines)
    assert capfd.readouterr().err == ""  # not a problem: nothing on stderr


MALFORMED = {
    "unknown algorithm": ("allreduce,0,10,rink,ll,-1,1,2\n", "unknown algorithm"),
    "unknown protocol": ("allreduce,0,10,ring,ll64,-1,1,2\n", "unknown protocol"),
    "unknown collective": ("alltoall,0,10,ring,ll,-1,1,2\n", "unknown collective"),
    "too few fields": ("allreduce,0,10,ring,ll,-1,1\n", "7 fields"),
    "too many fields": ("allreduce,0,10,ring,ll,-1,1,2,1,1,1\n", "fields where 8 to 10"),
    "min above max": ("allreduce,11,10,ring,ll,-1,1,2\n", "min"),
    "negative size": ("allreduce,-1,10,ring,ll,-1,1,2\n", "min"),
    "not a number": ("allreduce,0,1K,ring,ll,-1,1,2\n", "max"),
    "zero channels": ("allreduce,0,10,ring,ll,0,1,2\n", "channels"),
    "too many channels": ("allreduce,0,10,ring,ll,999,1,2\n", "channels"),
    "zero ranks": ("allreduce,0,10,ring,ll,-1,1,0\n", "nRanks"),
    "bad regBuff": ("allreduce,0,10,ring,ll,-1,1,2,-1,2\n", "regBuff"),
    "bad line after good": ("allreduce,0,10,ring,ll,-1,1,2\nallreduce,11,20,ring,xx,-1,1,2\n", "line 2"),
    "only comments": ("# nothing\n\n", "no rows"),
    "long line": ("allreduce,0,10,ring,ll,-1,1,2" + " " * 2000 + "\n", "longer than"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_tables_leave_every_choice_to_nccl(plugin, capfd, case):
    text, why = MALFORMED[case]
    p = plugin(text)
    for coll in T.COLLECTIVES:
        assert p.answer(coll, 5) is None
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0] and "NCCL keeps its own choices" in err[0]
    assert any(why in m for lvl, m in p.lines if lvl == 2)  # NCCL_LOG_WARN through NCCL's logger
    with pytest.raises(UserError, match="tuner table"):  # the Python reader refuses the same tables
        T.read_table(text)


def test_missing_table_file(plugin, lib, monkeypatch, tmp_path, capfd):
    monkeypatch.setenv(T.ENV_TABLE, str(tmp_path / "nope.csv"))
    p = Plugin(lib, 5, 2, 1)
    assert p.answer("allreduce", 1024) is None
    p.close()
    assert "cannot open the table" in capfd.readouterr().err
    with pytest.raises(UserError, match="does not exist"):
        T.load_table(tmp_path / "nope.csv")


def test_table_for_another_rank_count(plugin, capfd):
    p = plugin("allreduce,0,100,ring,ll,-1,1,8\n", ranks=2)
    assert p.answer("allreduce", 50) is None
    assert "no row for 2 ranks on 1 node(s) (it was written for 8 ranks)" in capfd.readouterr().err
    with pytest.raises(UserError, match="no row for 2 ranks on 1 node"):
        T.rows_for(T.read_table("allreduce,0,100,ring,ll,-1,1,8\n"), 2, 1)


NODES = """allreduce,0,1048575,ring,ll,-1,1,-1
allreduce,1048576,18446744073709551615,ring,simple,32,1,-1
allreduce,0,1048575,tree,ll,-1,2,-1
allreduce,1048576,18446744073709551615,tree,simple,16,2,-1
allreduce,0,18446744073709551615,ring,ll128,8,-1,16
"""


def test_rows_keyed_by_node_count(plugin):
    one, two = plugin(NODES, ranks=8, nodes=1), plugin(NODES, ranks=16, nodes=2)
    assert one.answer("allreduce", 1024) == ("ring", "ll", -1)
    assert one.answer("allreduce", 1 << 20) == ("ring", "simple", 32)
    assert two.answer("allreduce", 1024) == ("tree", "ll", -1)
    assert two.answer("allreduce", 1 << 30) == ("tree", "simple", 16)
    four = plugin(NODES, ranks=16, nodes=4)  # only the any-node row for 16 ranks applies
    assert four.answer("allreduce", 1024) == ("ring", "ll128", 8)
    eight = plugin(NODES, ranks=64, nodes=8)
    assert eight.answer("allreduce", 1024) is None
    assert any("no row for 64 ranks on 8 node(s)" in m for _, m in eight.lines)
    assert [r.nodes for r in T.rows_for(T.read_table(NODES), 16, 2)] == [2, 2, -1]


rows_strategy = st.lists(st.builds(
    lambda c, lo, span, a, p, ch, nodes, ranks: T.Row(c, lo, lo + span, a, p, ch, nodes, ranks),
    st.sampled_from(T.COLLECTIVES), st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.sampled_from(T.ALGORITHMS),
    st.sampled_from(T.PROTOCOLS), st.sampled_from([-1, 1, 2, 16, 64]), st.sampled_from([-1, 1, 2]),
    st.sampled_from([-1, 2, 4])), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(rows=rows_strategy, queries=st.lists(st.tuples(st.sampled_from(T.COLLECTIVES), st.integers(0, 5 << 20)),
                                            min_size=1, max_size=20),
       ranks=st.sampled_from([2, 4]), nodes=st.sampled_from([1, 2]),
       ignored=st.sets(st.tuples(st.sampled_from(T.ALGORITHMS), st.sampled_from(T.PROTOCOLS)), max_size=6))
def test_plugin_answers_as_the_python_rule(lib, tmp_path_factory, rows, queries, ranks, nodes, ignored):
    path = tmp_path_factory.mktemp("prop") / "t.csv"
    path.write_text(T.write_table(rows, ["property test"]))
    os.environ[T.ENV_TABLE] = str(path)
    try:
        p = Plugin(lib, 5, ranks, nodes)
    finally:
        del os.environ[T.ENV_TABLE]
    mine = [r for r in T.read_table(path.read_text()) if r.applies_to(ranks, nodes)]
    available = {(a, q) for a in T.ALGORITHMS for q in T.PROTOCOLS} - ignored
    for coll, nbytes in queries:
        assert p.answer(coll, nbytes, ignored) == T.decide(mine, coll, nbytes, available, reg_buff=0)
    p.close()


def test_table_round_trip_and_band_merging():
    rows = [T.Row("allreduce", 0, 99, "ring", "ll", -1, 1, 2), T.Row("allreduce", 100, 199, "ring", "ll", -1, 1, 2),
            T.Row("allreduce", 200, T.SIZE_MAX, "ring", "simple", 64, 1, 2),
            T.Row("allgather", 0, 10, "ring", "ll", -1, 1, 2, 3, 1)]
    assert T.read_table(T.write_table(rows, ["x"])) == rows
    merged = T.merge_bands(rows)
    assert merged[0] == T.Row("allreduce", 0, 199, "ring", "ll", -1, 1, 2) and len(merged) == 3
