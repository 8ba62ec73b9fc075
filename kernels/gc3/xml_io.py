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

from calibrate.errors import UserError
from kernels.gc3.ir import IR_VERSION, Buffer, Gpu, Program, Protocol, Step, StepType, ThreadBlock

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


def single_dep_form(program: Program) -> Program:
    """A copy of ``program`` where no step has more than one dependency (nops carry the extras)."""
    out = Program(**{k: getattr(program, k) for k in ("name", "collective", "ngpus", "nchunksperloop",
                                                         "nchannels", "protocol", "inplace", "min_bytes",
                                                         "max_bytes")})
    for gpu in program.gpus:
        # new index of every old (tb, step)
        newidx: dict[tuple[int, int], int] = {}
        for tb in gpu.threadblocks:
            k = 0
            for i, st in enumerate(tb.steps):
                k += max(len(st.deps) - 1, 0)
                newidx[(tb.id, i)] = k
                k += 1
        ng = Gpu(gpu.id, gpu.i_chunks, gpu.o_chunks, gpu.s_chunks)
        for tb in gpu.threadblocks:
            steps: list[Step] = []
            for st in tb.steps:
                deps = [(d, newidx[(d, s)]) for d, s in st.deps]
                for extra in deps[:-1]:
                    steps.append(Step(len(steps), StepType.NOP, Buffer.INPUT, -1, Buffer.OUTPUT, -1, 0,
                                      deps=[extra]))
                steps.append(Step(len(steps), st.type, st.srcbuf, st.srcoff, st.dstbuf, st.dstoff, st.cnt,
                                  deps=deps[-1:], has_dep=st.has_dep))
            ng.threadblocks.append(ThreadBlock(tb.id, tb.send, tb.recv, tb.chan, steps))
        out.gpus.append(ng)
    return out


def write_xml(program: Program) -> str:
    """MSCCL XML text for ``program`` (with our ``commtune_ir`` version attribute)."""
    program = single_dep_form(program)
    algo = ET.Element("algo", {
        "name": program.name, "proto": program.protocol.value, "nchannels": str(program.nchannels),
        "nchunksperloop": str(program.nchunksperloop), "ngpus": str(program.ngpus),
        "coll": program.collective, "inplace": str(int(program.inplace)),
        "outofplace": str(int(not program.inplace)), "minBytes": str(program.min_bytes),
        "maxBytes": str(program.max_bytes), VERSION_ATTR: str(IR_VERSION),
    })
    for gpu in program.gpus:
        gel = ET.SubElement(algo, "gpu", {"id": str(gpu.id), "i_chunks": str(gpu.i_chunks),
                                          "o_chunks": str(gpu.o_chunks), "s_chunks": str(gpu.s_chunks)})
        for tb in gpu.threadblocks:
            tel = ET.SubElement(gel, "tb", {"id": str(tb.id), "send": str(tb.send), "recv": str(tb.recv),
                                            "chan": str(tb.chan)})
            for st in tb.steps:
                depid, deps = st.deps[0] if st.deps else (-1, -1)
                ET.SubElement(tel, "step", {
                    "s": str(st.s), "type": st.type.value, "srcbuf": st.srcbuf.value, "srcoff": str(st.srcoff),
                    "dstbuf": st.dstbuf.value, "dstoff": str(st.dstoff), "cnt": str(st.cnt),
                    "depid": str(depid), "deps": str(deps), "hasdep": str(int(st.has_dep)),
                })
    ET.indent(algo, space="  ")
    return ET.tostring(algo, encoding="unicode") + "\n"
