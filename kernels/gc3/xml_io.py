"""Read and write MSCCL XML (../shared/interop/msccl/README.md) as ``ir.Program``.

Schema, as msccl-tools emits it: ``algo`` (name, proto, nchannels, nchunksperloop,
ngpus, coll, inplace, outofplace, minBytes, maxBytes) > ``gpu`` (id, i_chunks,
o_chunks, s_chunks) > ``tb`` (id, send, recv, chan) > ``step`` (s, type, srcbuf,
srcoff, dstbuf, dstoff, cnt, depid, deps, hasdep). We add one attribute of our own
on write, ``commtune_ir`` (``IR_VERSION``); a file without it is plain MSCCL.

MSCCL gives a step at most one dependency (``depid`` = thread block, ``deps`` =
step index). ``write_xml`` therefore spells a step with several dependencies as
``nop`` steps placed before it, each waiting on one of them; step indices of the
thread block shift and every reference to them is renumbered.

Which offsets address this GPU's own buffers (and are bounds-checked on read):
``s`` and ``rrs`` read src; ``r`` and ``rcs`` write dst (their src names the
peer's buffer, for information only); ``rrc``, ``rrcs``, ``cpy`` and ``re`` read
src and write dst.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from calibrate.errors import UserError
from kernels.gc3.ir import IR_VERSION, Buffer, Gpu, Program, Protocol, Step, StepType, ThreadBlock
from kernels.gc3.table import BUFFERS, STEP_TYPES, IRTable

VERSION_ATTR = "commtune_ir"


def local_operands(step: Step) -> list[tuple[str, Buffer, int]]:
    """The (role, buffer, offset) pairs of ``step`` that address this GPU's buffers."""
    t = step.type
    ops = []
    if t in (StepType.SEND, StepType.RECV_REDUCE_SEND, StepType.RECV_REDUCE_COPY,
             StepType.RECV_REDUCE_COPY_SEND, StepType.COPY, StepType.REDUCE):
        ops.append(("src", step.srcbuf, step.srcoff))
    if t in (StepType.RECV, StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_COPY,
             StepType.RECV_REDUCE_COPY_SEND, StepType.COPY, StepType.REDUCE):
        ops.append(("dst", step.dstbuf, step.dstoff))
    return ops


def _looks_like_path(src: str) -> bool:
    return not src.lstrip().startswith("<")


def _int(el: ET.Element, attr: str, where: str, default: int | None = None) -> int:
    raw = el.get(attr)
    if raw is None:
        if default is not None:
            return default
        raise UserError(f"{where}: missing attribute {attr!r}; regenerate the XML with msccl-tools "
                        f"or python -m kernels compile")
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{where}: attribute {attr}={raw!r} is not an integer; fix the value") from None


def _enum(cls, el: ET.Element, attr: str, where: str):
    raw = el.get(attr)
    try:
        return cls(raw)
    except ValueError:
        allowed = ", ".join(m.value for m in cls)
        raise UserError(f"{where}: unknown {attr}={raw!r} (expected one of {allowed}); fix the value") from None


def _read_step(el: ET.Element, where: str) -> Step:
    if el.tag != "step":
        raise UserError(f"{where}: unexpected element <{el.tag}> inside <tb>; only <step> is allowed")
    where = f"{where} step {el.get('s', '?')}"
    stype = _enum(StepType, el, "type", where)
    depid = _int(el, "depid", where, -1)
    depstep = _int(el, "deps", where, -1)
    if (depid < 0) != (depstep < 0):
        raise UserError(f"{where}: depid={depid} and deps={depstep} must both be -1 or both >= 0")
    return Step(
        s=_int(el, "s", where),
        type=stype,
        srcbuf=_enum(Buffer, el, "srcbuf", where),
        srcoff=_int(el, "srcoff", where),
        dstbuf=_enum(Buffer, el, "dstbuf", where),
        dstoff=_int(el, "dstoff", where),
        cnt=_int(el, "cnt", where),
        deps=[(depid, depstep)] if depid >= 0 else [],
        has_dep=_int(el, "hasdep", where, 0) != 0,
    )


def _check_gpu(gpu: Gpu, origin: str) -> None:
    ids = [tb.id for tb in gpu.threadblocks]
    if ids != list(range(len(ids))):
        raise UserError(f"{origin} gpu {gpu.id}: thread block ids {ids} are not 0..{len(ids) - 1}")
    for tb in gpu.threadblocks:
        where = f"{origin} gpu {gpu.id} tb {tb.id}"
        for i, st in enumerate(tb.steps):
            if st.s != i:
                raise UserError(f"{where}: step numbered {st.s} at position {i}; steps must be 0, 1, 2, ...")
            if st.cnt < 0:
                raise UserError(f"{where} step {i}: negative cnt={st.cnt}")
            if st.type == StepType.NOP:
                if st.cnt != 0:
                    raise UserError(f"{where} step {i}: a nop must have cnt=0, not {st.cnt}")
            elif st.cnt == 0:
                raise UserError(f"{where} step {i}: {st.type.value} with cnt=0; give it cnt >= 1")
            for role, buf, off in local_operands(st):
                size = gpu.chunks(buf)
                if off < 0 or off + st.cnt > size:
                    raise UserError(
                        f"{where} step {i} ({st.type.value}): {role} {buf.value}[{off}:{off + st.cnt}] is "
                        f"outside the buffer of {size} chunks ({buf.value}_chunks={size}); fix the offset "
                        f"or the buffer size")
            if st.type.sends and tb.send < 0:
                raise UserError(f"{where} step {i}: {st.type.value} sends but the thread block has send=-1")
            if st.type.receives and tb.recv < 0:
                raise UserError(f"{where} step {i}: {st.type.value} receives but the thread block has recv=-1")
            for dtb, dstep in st.deps:
                if dtb >= len(gpu.threadblocks) or dstep >= len(gpu.threadblocks[dtb].steps):
                    raise UserError(f"{where} step {i}: depends on tb {dtb} step {dstep}, which does not exist")


def read_xml(path_or_text: str | Path) -> Program:
    """Parse MSCCL XML from a file path or from the XML text itself into a ``Program``."""
    if isinstance(path_or_text, Path) or _looks_like_path(str(path_or_text)):
        path = Path(path_or_text)
        if not path.is_file():
            raise UserError(f"{path}: no such XML file; give the path of an MSCCL XML program")
        try:
            text, origin = path.read_bytes(), str(path)
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror}); give a readable MSCCL XML file") from None
    else:
        text, origin = str(path_or_text), "<xml text>"
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        line, col = e.position
        raise UserError(f"{origin}: malformed or truncated XML at line {line}, column {col}: {e}; "
                        f"regenerate the file") from None
    if root.tag != "algo":
        raise UserError(f"{origin}: root element is <{root.tag}>, expected <algo>; is this an MSCCL XML?")
    version = root.get(VERSION_ATTR)
    if version is not None and version != str(IR_VERSION):
        raise UserError(f"{origin}: {VERSION_ATTR}={version!r}, this tool reads version {IR_VERSION}; "
                        f"recompile it with python -m kernels compile")
    where = f"{origin} <algo>"
    prog = Program(
        name=root.get("name", ""),
        collective=root.get("coll") or "",
        ngpus=_int(root, "ngpus", where),
        nchunksperloop=_int(root, "nchunksperloop", where),
        nchannels=_int(root, "nchannels", where),
        protocol=_enum(Protocol, root, "proto", where),
        inplace=_int(root, "inplace", where, 0) != 0,
        min_bytes=_int(root, "minBytes", where, 0),
        max_bytes=_int(root, "maxBytes", where, 0),
    )
    if not prog.collective:
        raise UserError(f"{where}: missing attribute 'coll'; name the collective (allreduce, allgather, ...)")
    if prog.ngpus < 1 or prog.nchunksperloop < 1 or prog.nchannels < 1:
        raise UserError(f"{where}: ngpus, nchunksperloop and nchannels must be >= 1")
    for gel in root:
        if gel.tag != "gpu":
            raise UserError(f"{where}: unexpected element <{gel.tag}>; only <gpu> is allowed inside <algo>")
        gw = f"{origin} gpu {gel.get('id', '?')}"
        gpu = Gpu(id=_int(gel, "id", gw), i_chunks=_int(gel, "i_chunks", gw),
                  o_chunks=_int(gel, "o_chunks", gw), s_chunks=_int(gel, "s_chunks", gw))
        if min(gpu.i_chunks, gpu.o_chunks, gpu.s_chunks) < 0:
            raise UserError(f"{gw}: negative buffer size")
        for tel in gel:
            if tel.tag != "tb":
                raise UserError(f"{gw}: unexpected element <{tel.tag}>; only <tb> is allowed inside <gpu>")
            tw = f"{gw} tb {tel.get('id', '?')}"
            tb = ThreadBlock(id=_int(tel, "id", tw), send=_int(tel, "send", tw), recv=_int(tel, "recv", tw),
                             chan=_int(tel, "chan", tw))
            for peer, kind in ((tb.send, "send"), (tb.recv, "recv")):
                if peer >= prog.ngpus or peer < -1 or peer == gpu.id:
                    raise UserError(f"{tw}: {kind} peer {peer} is not another of the {prog.ngpus} GPUs")
            if not 0 <= tb.chan < prog.nchannels:
                raise UserError(f"{tw}: channel {tb.chan} outside 0..{prog.nchannels - 1} (nchannels)")
            tb.steps = [_read_step(sel, tw) for sel in tel]
            gpu.threadblocks.append(tb)
        prog.gpus.append(gpu)
    if [g.id for g in prog.gpus] != list(range(prog.ngpus)):
        raise UserError(f"{origin}: gpu ids {[g.id for g in prog.gpus]} are not 0..{prog.ngpus - 1} "
                        f"(ngpus={prog.ngpus}); the file may be truncated")
    for gpu in prog.gpus:
        _check_gpu(gpu, origin)
    return prog


def _attr(text: str) -> str:
    """An attribute value escaped as ElementTree escapes it."""
    for raw, entity in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ('"', "&quot;"), ("\r", "&#13;"),
                        ("\n", "&#10;"), ("\t", "&#09;")):
        text = text.replace(raw, entity)
    return text


def _single_dep_rows(t: IRTable):
    """The steps of ``t`` in single-dependency form, as rows: (original step, its dependency as a (thread
    block id, new step index) pair or (-1, -1), whether it is an inserted nop) in output order, and each
    thread block's new first row. A step with k > 1 dependencies is preceded by k - 1 nops."""
    ndeps = np.diff(t.dep_start)
    extra = np.maximum(ndeps - 1, 0)
    width = 1 + extra                                   # output rows per original step
    out_start = np.zeros(len(width) + 1, dtype=np.int64)
    np.cumsum(width, out=out_start[1:])
    tb_out = out_start[t.tb_start]                     # new first row of each thread block
    step_tb = t.step_tb()
    new_index = out_start[1:] - 1 - tb_out[step_tb]     # new index of each original step (after its nops)
    waiter = np.repeat(np.arange(t.steps), ndeps)
    dep_row = t.tb_start[t.tb_row(t.tb_gpu[step_tb[waiter]], t.dep_tb)] + t.dep_step
    # output row of dependency j of step k: the nops take deps 0..k-2, the step itself the last one
    j = np.arange(len(waiter)) - t.dep_start[waiter]
    row_of_dep = out_start[waiter] + j
    total = int(out_start[-1])
    src_step = np.repeat(np.arange(t.steps), width)
    is_nop = np.ones(total, dtype=bool)
    is_nop[out_start[1:] - 1] = False
    dep_tb = np.full(total, -1, dtype=np.int64)
    dep_idx = np.full(total, -1, dtype=np.int64)
    dep_tb[row_of_dep] = t.dep_tb
    dep_idx[row_of_dep] = new_index[dep_row]
    return src_step, is_nop, dep_tb, dep_idx, tb_out, total


def write_xml(program: Program | IRTable) -> str:
    """MSCCL XML text for ``program`` (with our ``commtune_ir`` version attribute), written as
    ElementTree writes it (two-space indent); a step with several dependencies is spelled with nops.
    O(S + D) for S steps and D dependencies, one line per step."""
    t = program if isinstance(program, IRTable) else IRTable.from_program(program)
    src_step, is_nop, dep_tb, dep_idx, tb_out, total = _single_dep_rows(t)
    types = [st.value for st in STEP_TYPES]
    bufs = [b.value for b in BUFFERS]
    typ = np.where(is_nop, STEP_TYPES.index(StepType.NOP), t.st_type[src_step]).tolist()
    sb = np.where(is_nop, BUFFERS.index(Buffer.INPUT), t.st_srcbuf[src_step]).tolist()
    db = np.where(is_nop, BUFFERS.index(Buffer.OUTPUT), t.st_dstbuf[src_step]).tolist()
    so = np.where(is_nop, -1, t.st_srcoff[src_step]).tolist()
    do = np.where(is_nop, -1, t.st_dstoff[src_step]).tolist()
    cnt = np.where(is_nop, 0, t.st_cnt[src_step]).tolist()
    hd = np.where(is_nop, False, t.st_hasdep[src_step]).astype(int).tolist()
    dtb, didx = dep_tb.tolist(), dep_idx.tolist()
    head = (f'<algo name="{_attr(t.name)}" proto="{t.protocol.value}" nchannels="{t.nchannels}" '
            f'nchunksperloop="{t.nchunksperloop}" ngpus="{t.ngpus}" coll="{_attr(t.collective)}" '
            f'inplace="{int(t.inplace)}" outofplace="{int(not t.inplace)}" minBytes="{t.min_bytes}" '
            f'maxBytes="{t.max_bytes}" {VERSION_ATTR}="{IR_VERSION}"')
    if not len(t.gpu_id):
        return head + " />\n"
    lines = [head + ">"]
    tbs_of = np.searchsorted(t.tb_gpu, np.arange(len(t.gpu_id) + 1)).tolist()
    tb_out = np.append(tb_out, total).tolist()
    for g, (gid, (i, o, sc)) in enumerate(zip(t.gpu_id.tolist(), t.gpu_chunks.tolist())):
        gpu = f'  <gpu id="{gid}" i_chunks="{i}" o_chunks="{o}" s_chunks="{sc}"'
        if tbs_of[g] == tbs_of[g + 1]:
            lines.append(gpu + " />")
            continue
        lines.append(gpu + ">")
        for k in range(tbs_of[g], tbs_of[g + 1]):
            tb = (f'    <tb id="{int(t.tb_id[k])}" send="{int(t.tb_send[k])}" recv="{int(t.tb_recv[k])}" '
                  f'chan="{int(t.tb_chan[k])}"')
            lo, hi = tb_out[k], tb_out[k + 1]
            if lo == hi:
                lines.append(tb + " />")
                continue
            lines.append(tb + ">")
            lines.extend(f'      <step s="{r - lo}" type="{types[typ[r]]}" srcbuf="{bufs[sb[r]]}" srcoff="{so[r]}" '
                         f'dstbuf="{bufs[db[r]]}" dstoff="{do[r]}" cnt="{cnt[r]}" depid="{dtb[r]}" '
                         f'deps="{didx[r]}" hasdep="{hd[r]}" />' for r in range(lo, hi))
            lines.append("    </tb>")
        lines.append("  </gpu>")
    lines.append("</algo>\n")
    return "\n".join(lines)
