"""Forged, damaged and hostile torch-tweak files, loaded one by one in this process.

Run by tests/test_forged_files.py per category: ``python forgery.py make CATEGORY FOLDER``
writes the genuine files and every case, then ``python forgery.py load CATEGORY FOLDER``, a
new process whose memory is watched, loads them, so that a case that hangs, crashes or eats
memory is caught by the parent. Every case is loaded twice: as it is, and with a key (which
every forged file lacks). Each prints one JSON line: the case, what tt.load did ("error": a
CheckpointError; "correct": it loaded and the model answers exactly as the untuned one;
anything else is a failure), whether the model was left unchanged after an error, and
whether a marker file appeared (code ran). The last line holds the peak memory growth of
the loading process.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import resource
import socket
import sys
import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._store import checkpoint
from torch_tweak.backends import TorchEagerBackend

KEY = b"deployment secret of the tests"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) + x)


def build() -> Net:
    torch.manual_seed(0)
    return Net().eval()


INPUTS = [torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),
          torch.randn(4, 16, generator=torch.Generator().manual_seed(2))]
with torch.no_grad():
    EXPECTED = [build()(x) for x in INPUTS]


def genuine(folder: Path) -> tuple[Path, Path]:
    """A tuned Net saved twice: unsealed by a key, and sealed with KEY."""
    model = build()
    tt.wrap(model, ["body", "head"], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(model, INPUTS + INPUTS)
    plain, signed = folder / "genuine.tt", folder / "signed.tt"
    tt.save(model, plain)
    tt.save(model, signed, key=KEY)
    return plain, signed


def members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {n: archive.read(n) for n in archive.namelist()}


def forge(folder: Path, name: str, changes: dict[str, bytes | None], base: dict[str, bytes],
          manifest: dict | None = None, fix_hashes: bool = True) -> Path:
    """A file made from `base` with members replaced (None: removed), its manifest hashes
    recomputed and sealed without a key: all a forger without the key can do."""
    files = {**base, **changes}
    files = {n: d for n, d in files.items() if d is not None}
    if "manifest.json" not in changes:  # a manifest given whole is written as it is
        meta = json.loads(files["manifest.json"])
        meta.update(manifest or {})
        if fix_hashes:
            meta["members"] = {n: hashlib.sha256(d).hexdigest() for n, d in files.items() if n != "manifest.json"}
        files["manifest.json"] = json.dumps(meta).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for member, data in files.items():  # compressed as tt.save compresses
            compress = zipfile.ZIP_DEFLATED if member.endswith(".json") else zipfile.ZIP_STORED
            archive.writestr(member, data, compress_type=compress)
    path = folder / f"{name}.tt"
    path.write_bytes(checkpoint._seal(buffer.getvalue(), None))
    return path


def with_plan(folder: Path, name: str, base: dict[str, bytes], edit) -> Path:
    plan = json.loads(base["plan.json"])
    edit(plan)
    return forge(folder, name, {"plan.json": json.dumps(plan).encode()}, base)


def state_of(model: nn.Module):
    return (type(model), [(p, id(m), type(m), m.training) for p, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def unchanged(model: nn.Module, before) -> bool:
    cls, modules, tensors = before
    after = model.state_dict()
    return (type(model) is cls and not tt.installed(model)
            and [(p, id(m), type(m), m.training) for p, m in model.named_modules()] == modules
            and list(after) == list(tensors) and all(torch.equal(after[k], v) for k, v in tensors.items()))


def outcome(path: Path, marker: Path, given: bool = False, **kwargs) -> dict:
    if given:
        kwargs["backends"] = [tt.backends.TorchInductorBackend(), tt.backends.OpenVINOBackend(),
                              tt.backends.InductorGraphBackend(), TorchEagerBackend()]
    model = build()
    before = state_of(model)
    result: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tt.load(model, path, **kwargs)
        except tt.CheckpointError as exc:
            result = {"outcome": "error", "unchanged": unchanged(model, before), "message": str(exc)[:300]}
        except BaseException as exc:  # anything else is a finding, reported as such
            result = {"outcome": f"raised {type(exc).__name__}", "message": str(exc)[:300]}
        else:
            with torch.no_grad():
                same = all(torch.equal(model(x), e) for x, e in zip(INPUTS, EXPECTED))
            result = {"outcome": "correct" if same else "wrong outputs"}
    result["code_ran"] = marker.exists()
    return result


# ------------------------------------------------------------------ the categories


def options(folder: Path, base: dict, marker: Path):
    """Free-form values that would reach a compiler or a runtime, and values outside a schema."""
    shell = f"true; touch {marker}"
    inductor = "torch_tweak.backends.inductor:TorchInductorBackend"
    graph = "torch_tweak.backends.graph:InductorGraphBackend"
    openvino = "torch_tweak.backends.openvino:OpenVINOBackend"
    eager = "torch_tweak.backends.eager:TorchEagerBackend"
    torchao = "torch_tweak.backends.torchao:TorchAOBackend"
    dangerous = [
        (inductor, {"options": {"dict": {"cpp.cxx": {"tuple": [shell]}}}}),
        (inductor, {"options": {"dict": {"cpp.march": shell}}}),
        (inductor, {"options": {"dict": {"debug": True, "trace.enabled": True, "trace.debug_dir": str(folder)}}}),
        (inductor, {"options": {"dict": {"test_configs.runtime_triton_dtype_assert": True}}}),
        (inductor, {"options": {"dict": {"cpp_wrapper": True, "aot_inductor.output_path": str(marker)}}}),
        (inductor, {"options": {"dict": {"": None}}}),
        (inductor, {"options": {"fingerprint": "0" * 32}}),
        (inductor, {"options": [shell]}),
        (inductor, {"options": shell}),
        (graph, {"options": {"dict": {"cpp.cxx": {"tuple": [shell]}}}}),
        (graph, {"options": {"fingerprint": "f" * 32}}),
        (openvino, {"properties": {"dict": {"CACHE_DIR": str(folder)}}}),
        (openvino, {"properties": {"dict": {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}}}),
        (openvino, {"properties": {"fingerprint": "1" * 32}}),
        (openvino, {"ov_device": f"CPU;{shell}"}),
        (openvino, {"ov_device": "../../" + str(marker)}),
        (openvino, {"ov_device": "HETERO:CPU,GPU"}),
        (inductor, {"mode": "evil"}),
        (inductor, {"mode": {"tuple": ["max-autotune"]}}),
        (inductor, {"fullgraph": "yes"}),
        (inductor, {"dynamic": 1}),
        (inductor, {"nonexistent_field": 1}),
        (graph, {"warmup": 10 ** 9}),
        (graph, {"warmup": 0}),
        (graph, {"warmup": True}),
        (graph, {"capture_error_mode": "anything"}),
        (graph, {"mode": "reduce-overhead"}),
        (openvino, {"performance_hint": "NONE"}),
        (openvino, {"conversion": "pickle"}),
        (openvino, {"inference_precision": "f8"}),
        (openvino, {"inference_precision": "bf16"}),  # lower precision: only when the caller passes it
        (openvino, {"inference_precision": "f16", "tolerance": 0.05}),
        (eager, {"autocast_dtype": {"dtype": "int8"}}),
        (eager, {"autocast_dtype": {"dtype": "Tensor"}}),
        (eager, {"autocast_dtype": {"module": "os"}}),
        (eager, {"autocast_dtype": "float16"}),
        (torchao, {"mode": "int8_weight_only"}),  # opt-in: only when the caller passes it
        (torchao, {"mode": "int4"}),
        ("torch_tweak.backends.graph:DeviceGraphBackend", {"share_pool": "true"}),
    ]
    for i, (cls, config) in enumerate(dangerous):
        def edit(plan, cls=cls, config=config):
            for module in plan["modules"]:
                for sig in module["signatures"]:
                    sig["backend"] = {"name": "x", "class": cls, "config": config}
        path = with_plan(folder, f"options{i}", base, edit)
        yield f"options {i}: {cls.rpartition(':')[2]} {json.dumps(config)[:80]}", path, "error", {}
        # the caller's own backends of that class, with their defaults, do not unlock the file's values
        yield f"options {i} with default backends given", path, "error", {"given": True}


def tolerances(folder: Path, base: dict, marker: Path):
    """Tolerances out of range are refused; in range, a file cannot widen the check past the cap."""
    for i, value in enumerate([1e9, -1, {"float": "nan"}, {"float": "inf"}, "0.1", True, [0.1], 1.5, {"tuple": [0]}]):
        def edit(plan, value=value):
            plan["modules"][0]["signatures"][0]["backend"]["config"]["tolerance"] = value
        yield f"tolerance {json.dumps(value)}", with_plan(folder, f"tol{i}", base, edit), "error", {}
    samples = members_of_samples(base)
    for scale in (0.2, 0.5, 0.99):
        # outputs moved by `scale` of their range, with the widest tolerance the schema admits: the
        # rebuilt backend must fail the capped check and run the original (the model stays correct)
        def edit(plan):
            for module in plan["modules"]:
                for sig in module["signatures"]:
                    sig["backend"]["config"]["tolerance"] = 1.0
        plan = json.loads(base["plan.json"])
        edit(plan)
        shifted = {k: v + scale * v.abs().max() if k in samples["outputs"] else v for k, v in samples["tensors"].items()}
        from safetensors.torch import save as save_tensors
        path = forge(folder, f"shifted{scale}", {"plan.json": json.dumps(plan).encode(),
                                                  "samples.safetensors": save_tensors(shifted)}, base)
        yield f"reference outputs shifted by {scale} with tolerance 1.0", path, "correct", {}
        # the file's correctness rule: a fixed tolerance of 1.0 for every backend is capped, and under
        # the measured rule (no tolerance named) the file's outputs must be the module's own
        for rule in (1.0, None):
            plan = json.loads(base["plan.json"])
            if rule is not None:
                plan["tolerance"] = rule
            path = forge(folder, f"shifted{scale}-rule{rule}", {"plan.json": json.dumps(plan).encode(),
                                                                 "samples.safetensors": save_tensors(shifted)}, base)
            yield f"reference outputs shifted by {scale} under the file's rule {rule}", path, "correct", {}
    for i, value in enumerate([2.0, -0.5, "loose", {"float": "nan"}, [0.1], True]):
        def edit(plan, value=value):
            plan["tolerance"] = value
        yield f"the plan's rule {json.dumps(value)}", with_plan(folder, f"rule{i}", base, edit), "error", {}


def members_of_samples(base: dict) -> dict:
    from safetensors.torch import load as load_tensors
    tensors = load_tensors(base["samples.safetensors"])
    plan = json.loads(base["plan.json"])
    outputs = set()

    def refs(tree):
        if isinstance(tree, dict):
            if "tensor" in tree:
                yield f"t{tree['tensor']}"
            for v in tree.values():
                yield from refs(v)
        elif isinstance(tree, list):
            for v in tree:
                yield from refs(v)

    for module in plan["modules"]:
        for sig in module["signatures"]:
            outputs.update(refs(sig["outputs"]))
    return {"tensors": tensors, "outputs": outputs}


def classes(folder: Path, base: dict, marker: Path):
    """Class names: of backends, of the root model, of modules."""
    names = ["os:system", "builtins:eval", "subprocess:Popen", "torch_tweak.backends.base:Backend",
             "torch_tweak.backends.base:BackendUnavailable", "support:CountingBackend", "__main__:Net",
             "torch_tweak.backends.eager:TorchEagerBackendConfig", "torch.nn:Linear", "", ":", "a" * 5000,
             "torch_tweak.backends.eager:TorchEagerBackend\x00", "torch_tweak.backends.eager:torchEagerBackend"]
    for i, name in enumerate(names):
        def edit(plan, name=name):
            plan["modules"][-1]["signatures"][0]["backend"]["class"] = name
        yield f"backend class {name[:60]!r}", with_plan(folder, f"cls{i}", base, edit), "error", {}
    for i, value in enumerate([5, None, [], {"dict": {}}]):
        def edit(plan, value=value):
            plan["modules"][0]["signatures"][0]["backend"]["class"] = value
        yield f"backend class {value!r}", with_plan(folder, f"clsv{i}", base, edit), "error", {}
    for i, root in enumerate(["os:system", "__main__:Other", "torch.nn.modules.container:Sequential", "", 7]):
        yield (f"root class {root!r}", forge(folder, f"root{i}", {}, base, manifest={"model": root}), "error", {})
    for i, cls in enumerate(["os:system", "torch.nn.modules.linear:Identity", 3]):
        def edit(plan, cls=cls):
            plan["modules"][0]["class"] = cls
        yield f"module class {cls!r}", with_plan(folder, f"mcls{i}", base, edit), "error", {}


def sizes(folder: Path, base: dict, marker: Path):
    """Members that inflate past every cap, declared sizes that lie, too many of everything."""
    for name, total in (("plan.json", 300 << 20), ("samples.safetensors", 600 << 20), ("manifest.json", 200 << 20)):
        yield f"{name} inflating to {total >> 20} MiB", reseal(bomb(folder, name, total, base)), "error", {}
    yield "junk file of 300 MiB", big_junk(folder), "error", {}
    deep = "[" * 100000 + "]" * 100000
    yield "plan nested 100k deep", forge(folder, "deep-plan", {"plan.json": deep.encode()}, base), "error", {}
    deep_manifest = folder / "deep-manifest.tt"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("manifest.json", ("{\"a\":" * 50000 + "1" + "}" * 50000).encode())
    deep_manifest.write_bytes(checkpoint._seal(buffer.getvalue(), None))
    yield "manifest nested 50k deep", deep_manifest, "error", {}
    yield ("a number of a million digits", forge(folder, "bigint", {"plan.json": b'{"depth": ' + b"9" * 1000000
                                                                   + b', "modules": []}'}, base), "error", {})

    def many_samples(plan):
        sig = plan["modules"][0]["signatures"][0]
        sig["samples"] = sig["samples"][:1] * 1000000
        sig["outputs"] = sig["outputs"][:1] * 1000000
    yield "a million stored calls", with_plan(folder, "many-calls", base, many_samples), "error", {}

    def many_signatures(plan):
        plan["modules"][0]["signatures"] = plan["modules"][0]["signatures"] * 1000
    yield "a thousand signatures", with_plan(folder, "many-sigs", base, many_signatures), "error", {}

    def many_modules(plan):
        plan["modules"] = plan["modules"] * 1000
    yield "a module listed a thousand times", with_plan(folder, "many-modules", base, many_modules), "error", {}
    extra = {f"junk/{i}": b"x" for i in range(5000)}
    yield "five thousand members", forge(folder, "many-members", extra, base), "error", {}
    header = b'{"t0":{"dtype":"F32","shape":[1000000000,1000],"data_offsets":[0,4000000000000]}}'
    fake = len(header).to_bytes(8, "little") + header
    yield "samples declaring a 4 TB tensor", forge(folder, "huge-tensor", {"samples.safetensors": fake}, base), "error", {}
    long_header = (10 ** 12).to_bytes(8, "little") + b"{}"
    yield "samples declaring a 1 TB header", forge(folder, "huge-header", {"samples.safetensors": long_header},
                                                    base), "error", {}
    yield "a string of 50 MB in the plan", forge(folder, "long-string", {"plan.json": json.dumps(
        {"depth": "x" * (50 << 20), "modules": []}).encode()}, base), "error", {}


def bomb(folder: Path, name: str, total: int, base: dict) -> Path:
    """The genuine file with `name` replaced by `total` deflated spaces, written streamed (memory
    stays small); the manifest keeps the genuine hash."""
    out = folder / f"bomb-{name}.tt"
    with zipfile.ZipFile(out, "w") as archive:
        for member, data in base.items():
            if member == name:
                info = zipfile.ZipInfo(member)
                info.compress_type = zipfile.ZIP_DEFLATED
                with archive.open(info, "w", force_zip64=True) as f:
                    chunk = b" " * (1 << 20)
                    for _ in range(total >> 20):
                        f.write(chunk)
            else:
                archive.writestr(member, data, compress_type=zipfile.ZIP_DEFLATED)
    return out


def reseal(path: Path) -> Path:
    path.write_bytes(checkpoint._seal(path.read_bytes(), None))
    return path


def big_junk(folder: Path) -> Path:
    path = folder / "junk.tt"
    with open(path, "wb") as f:
        for _ in range(300):
            f.write(os.urandom(1 << 20))
    return path


def paths(folder: Path, base: dict, marker: Path):
    """Paths that are not regular files."""
    fifo = folder / "fifo.tt"
    os.mkfifo(fifo)
    link = folder / "zero-link.tt"
    link.symlink_to("/dev/zero")
    loop = folder / "loop.tt"
    loop.symlink_to(loop)
    sock_path = folder / "socket.tt"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    for path in ("/dev/zero", "/dev/urandom", "/dev/null", fifo, link, loop, folder, sock_path, "/proc/self/environ",
                 "/proc/self/mem"):
        yield f"path {path}", Path(path), "error", {}
    server.close()


def damage(folder: Path, base: dict, marker: Path):
    """Random damage to a genuine file: flipped bytes, truncations, zeroed runs, junk appended."""
    rng = random.Random(12345)
    for source in ("genuine.tt", "signed.tt"):
        good = (folder / source).read_bytes()
        for i in range(150):
            at = rng.randrange(len(good))
            bad = good[:at] + bytes([good[at] ^ (1 << rng.randrange(8))]) + good[at + 1:]
            yield f"{source}: bit flipped at byte {at}", write(folder, f"flip-{source}-{i}", bad), "error", {}
        for i in range(15):
            at = rng.randrange(len(good))
            yield f"{source}: truncated to {at} bytes", write(folder, f"cut-{source}-{i}", good[:at]), "error", {}
        for i in range(15):
            at = rng.randrange(len(good))
            bad = good[:at] + bytes(min(64, len(good) - at)) + good[at + 64:]
            yield f"{source}: 64 bytes zeroed at {at}", write(folder, f"zero-{source}-{i}", bad), "error", {}
        for i, junk in enumerate((b"\0", b"PK\x05\x06" + bytes(18), os.urandom(1000))):
            yield f"{source}: junk appended ({len(junk)} bytes)", write(folder, f"tail-{source}-{i}", good + junk), \
                "error", {}


def write(folder: Path, name: str, data: bytes) -> Path:
    path = folder / f"{name}.tt"
    path.write_bytes(data)
    return path


class Payload:
    """Unpickling this creates the marker: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def pickles(folder: Path, base: dict, marker: Path):
    payload = pickle.dumps(Payload(marker))
    pt = folder / "torch-save.tt"
    torch.save({"w": Payload(marker)}, pt)
    yield "a torch.save file", pt, "error", {}
    yield "a bare pickle", write(folder, "bare", payload), "error", {}
    for member in ("plan.json", "samples.safetensors", "manifest.json"):
        yield f"a pickle as {member}", forge(folder, f"pickle-{member}", {member: payload}, base), "error", {}
    yield ("a pickle as the artifacts, not trusted", forge(folder, "pickle-art", {"artifacts/inductor.bin": payload},
                                                           base), "correct", {})


# Values a forger puts anywhere in the plan or the manifest.
ALTERNATES = [None, -1, 2 ** 70, 1e308, "x", "", [], {}, True, {"tensor": 999}, {"tensor": -1}, {"tuple": 5},
              {"dict": []}, {"dtype": "Tensor"}, {"device": "cuda:99"}, {"fingerprint": "0"}, [[[[[[[]]]]]]]]


def tree(folder: Path, base: dict, marker: Path):
    """Every node of the plan and manifest replaced by every alternate value (a sample of them)."""
    rng = random.Random(7)
    cases = []
    for member in ("plan.json", "manifest.json"):
        doc = json.loads(base[member])
        for where in nodes(doc):
            for value in ALTERNATES:
                cases.append((member, where, value))
    rng.shuffle(cases)
    for i, (member, where, value) in enumerate(cases[:320]):
        doc = json.loads(base[member])
        put(doc, where, value)
        if member == "manifest.json":
            path = forge(folder, f"tree{i}", {}, base, manifest=doc)
        else:
            path = forge(folder, f"tree{i}", {member: json.dumps(doc).encode()}, base)
        yield f"{member} {'/'.join(map(str, where))} = {json.dumps(value)[:40]}", path, "either", {}


def nodes(doc, where=()):
    if where:
        yield where
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from nodes(v, where + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from nodes(v, where + (i,))


def put(doc, where, value) -> None:
    for step in where[:-1]:
        doc = doc[step]
    doc[where[-1]] = value


CATEGORIES = {"options": options, "tolerances": tolerances, "classes": classes, "sizes": sizes, "paths": paths,
              "damage": damage, "pickles": pickles, "tree": tree}


def main() -> None:
    step, category, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    marker = folder / "marker"
    if step == "make":
        folder.mkdir(parents=True, exist_ok=True)
        plain, _ = genuine(folder)
        cases = [(name, str(path), expected, kwargs)
                 for name, path, expected, kwargs in CATEGORIES[category](folder, members(plain), marker)]
        (folder / "cases.json").write_text(json.dumps(cases))
        return
    for path, kwargs in ((folder / "genuine.tt", {}), (folder / "signed.tt", {"key": KEY}), (folder / "signed.tt", {})):
        found = outcome(path, marker, **kwargs)
        assert found["outcome"] == "correct", found  # the genuine files load, with and without the key
    cases = json.loads((folder / "cases.json").read_text())
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name, path, expected, kwargs in cases:
        path = Path(path)
        print(json.dumps({"start": name}), flush=True)
        found = outcome(path, marker, **kwargs)
        keyed = outcome(path, marker, key=KEY, **kwargs)  # nothing forged carries the key's seal
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({"case": name, "expected": expected, **found, "keyed": keyed, "peak_rss": rss}), flush=True)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) * 1024
    print(json.dumps({"peak_growth_bytes": grown, "model_bytes": checkpoint.model_bytes(build())}), flush=True)


if __name__ == "__main__":
    main()
