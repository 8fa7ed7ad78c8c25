"""tt.save and tt.load: round trip, atomic save, and every bad input (the model left as it was)."""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import io
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import zipfile

import pytest
import torch
from torch import nn

import torch_tweak as tt
from torch_tweak._store import checkpoint, serial
from torch_tweak._core import correctness, schema
from torch_tweak._search import plan as planning
from torch_tweak._core.schema import Fraction
from torch_tweak.backends import TorchEagerBackend
from support import FAST, MLP, BrokenBackend, CountingBackend, encoder
from test_api import assert_unchanged, snapshot

TESTS = os.path.dirname(os.path.abspath(__file__))


def fresh_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


def two_shapes() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(2)] + [torch.randn(4, 16, generator=g) for _ in range(2)]


def choices(model: nn.Module) -> dict[str, list]:
    return {p: [(g.text, None if g.backend is None else type(g.backend).__name__) for g in w.tt_signatures]
            for p, w in tt.installed(model).items()}


@pytest.fixture
def saved(tmp_path):
    """A tuned MLP (two input signatures per module, the Counting backend) saved to model.tt."""
    model = fresh_mlp()
    data = two_shapes()
    tt.wrap(model, ["blocks.0", "blocks.1", "head"], strategy=tt.FirstWinsStrategy([BrokenBackend(), CountingBackend()]))
    tt.tune(model, data, measure=FAST)  # wrap and tune: a tweak might find the untuned model faster
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / "model.tt"
    tt.save(model, path)
    return model, data, path


def rewrite(path, changes: dict[str, bytes], fix_hashes: bool = True, manifest: dict | None = None) -> None:
    """Replaces members of a saved file (and their hashes in the manifest, unless told not to)."""
    with zipfile.ZipFile(path) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    members.update(changes)
    meta = json.loads(members["manifest.json"])
    if manifest:
        meta.update(manifest)
    if fix_hashes:
        meta["members"] = {n: hashlib.sha256(d).hexdigest() for n, d in members.items() if n != "manifest.json"}
    members["manifest.json"] = json.dumps(meta).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    path.write_bytes(checkpoint._seal(buffer.getvalue(), None))  # anyone can seal without a key


class Payload:
    """Unpickling this creates the marker file: proof that a pickle ran."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


# ------------------------------------------------------------------ round trip


@pytest.mark.slow
def test_round_trip_same_outputs_and_backends(saved):
    model, data, path = saved
    with torch.no_grad():
        expected = [model(x) for x in data]
    fresh = fresh_mlp()
    builds = CountingBackend.builds
    chosen = tt.load(fresh, path, backends=[CountingBackend()])
    assert chosen == {"blocks.0": "Counting", "blocks.1": "Counting", "head": "Counting"}
    assert choices(fresh) == choices(model)
    # (8, 16) and (4, 16): one shape class, batch 4 to 8 (signatures.merge_varying)
    assert all([g.varying for g in w.tt_signatures] == [True] for w in tt.installed(fresh).values())
    assert CountingBackend.builds - builds == 3  # built again per module and signature, no tuning
    with torch.no_grad():
        got = [fresh(x) for x in data]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert all(g.backend.calls > 0 for w in tt.installed(fresh).values() for g in w.tt_signatures)
    summary = checkpoint.read_summary(path)
    assert summary["manifest"]["format"] == "torch-tweak" and summary["manifest"]["device"]["type"] == "cpu"
    assert summary["manifest"]["model"].endswith(":MLP")
    assert summary["plan"]["depth"] is None  # wrapped by hand: no depth
    head = next(m for m in summary["plan"]["modules"] if m["path"] == "head")
    assert head["params"]["weight"] == [[4, 16], "float32"]
    assert head["signatures"][0]["backend"]["class"] == "support:CountingBackend"
    tt.save(fresh, path)  # a loaded model saves again, with its calls
    again = fresh_mlp()
    tt.load(again, path, backends=[CountingBackend()])
    assert choices(again) == choices(model)


def test_saving_through_a_symlink_writes_its_target_and_keeps_the_link(saved, tmp_path):
    """Found by an attack: the rename over the path replaced a link with a file, leaving its
    target as it was; open() and torch.save write through the link."""
    import os

    model, data, path = saved
    link = tmp_path / "current.tt"
    os.symlink(path, link)
    path.write_bytes(b"an older file")  # what the link points at before the save
    tt.save(model, link)
    assert link.is_symlink() and os.path.realpath(link) == os.path.realpath(path)
    assert path.read_bytes() != b"an older file"  # the target got the new file
    assert not any(p.name.endswith(".tmp") for p in path.parent.iterdir())
    fresh = fresh_mlp()
    tt.load(fresh, path, backends=[CountingBackend()])
    with torch.no_grad():
        for x in data:
            assert torch.equal(fresh(x), model(x))


def test_saving_to_a_folder_says_so_and_writes_nothing(saved, tmp_path):
    """Found by an attack: the rename's IsADirectoryError named the temporary file."""
    model, data, path = saved
    folder = tmp_path / "plans"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match="plans is a folder: give the path of a file"):
        tt.save(model, folder)
    assert list(folder.iterdir()) == [] and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_untuned_model_saves_an_empty_plan(tmp_path, mlp_data):
    model = fresh_mlp()
    with pytest.raises(ValueError, match="nothing to save"):
        tt.save(model, tmp_path / "m.tt")
    tt.tweak(model, mlp_data, max_depth=0, dry_run=False, strategy=tt.OneBackendStrategy(BrokenBackend()),
             progress=False, measure=FAST)
    assert not tt.installed(model)
    tt.save(model, tmp_path / "m.tt")
    fresh = fresh_mlp()
    assert tt.load(fresh, tmp_path / "m.tt") == {}
    assert not tt.installed(fresh)


def test_backend_configs_round_trip_through_json():
    backend = TorchEagerBackend(autocast_dtype=torch.bfloat16, tolerance=0.25)
    tree = json.loads(serial.dumps(serial.describe_backend(backend)))
    with pytest.raises(ValueError, match="lower precision .* is opt-in"):  # autocast lowers precision: the caller's
        serial.build_backend(tree)
    rebuilt = serial.build_backend(tree, [TorchEagerBackend(autocast_dtype=torch.bfloat16, tolerance=0.25)])
    assert type(rebuilt) is TorchEagerBackend and rebuilt.config == backend.config
    plain = TorchEagerBackend(memory_format="channels_last", tolerance=0.25)
    rebuilt = serial.build_backend(json.loads(serial.dumps(serial.describe_backend(plain))))
    assert type(rebuilt) is TorchEagerBackend and rebuilt.config == plain.config and rebuilt.name == plain.name
    custom = CountingBackend(tolerance=0.01)
    given = serial.build_backend(json.loads(serial.dumps(serial.describe_backend(custom))), [custom])
    assert type(given) is CountingBackend and given is not custom and given.config == custom.config


def test_values_round_trip_and_unknown_tags_are_refused():
    tensors: list[torch.Tensor] = []
    value = ((torch.ones(2), [1, 2.5, float("inf")]), {"mask": None, "dtype": torch.float16, "on": torch.device("cpu"),
                                                        "pair": (True, "x")})
    tree = json.loads(serial.dumps(serial.encode(value, tensors)))
    back = serial.decode(tree, tensors)
    assert back[0][1] == [1, 2.5, float("inf")] and back[1]["dtype"] is torch.float16 and back[1]["pair"] == (True, "x")
    assert torch.equal(back[0][0], torch.ones(2))
    with pytest.raises(serial.Unstorable):
        serial.encode(object(), tensors)
    for bad in ({"dtype": "Tensor"}, {"module": "os"}, {"tensor": 5}):
        with pytest.raises(ValueError):
            serial.decode(bad, tensors)


@pytest.mark.slow
def test_encoder_with_inductor_round_trip(encoder_tweak, tmp_path):
    model, data, expected, result = encoder_tweak
    path = tmp_path / "encoder.tt"
    tt.save(model, path)
    names = zipfile.ZipFile(path).namelist()
    inductor = any(m.backend and "TorchInductor" in m.backend for p, m in result.modules.items()
                   if p in tt.installed(model))
    assert ("artifacts/inductor.bin" in names) == inductor
    fresh = encoder.build()
    chosen = tt.load(fresh, path, trust_artifacts=True)
    assert chosen == {p: w.tt_backend.name if w.tt_backend else None for p, w in tt.installed(model).items()}
    with torch.no_grad():
        for x, e in zip(data, expected):
            assert float((fresh(x) - e).abs().max() / e.abs().max()) <= tt.TOLERANCES[torch.float32]


# ------------------------------------------------------------------ atomic save


def test_save_interrupted_by_an_exception_keeps_the_earlier_file(saved, monkeypatch):
    model, _, path = saved
    before = path.read_bytes()
    original = zipfile.ZipFile.writestr
    written = []

    def failing(self, *args, **kwargs):
        if written:
            raise OSError("disk full")
        written.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "writestr", failing)
    with pytest.raises(OSError, match="disk full"):
        tt.save(model, path)
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == ["model.tt"]  # no temporary file left behind


KILLED_SAVE = """
import sys, time, zipfile
import torch, torch_tweak as tt
from support import FAST, MLP, CountingBackend
torch.manual_seed(0)
model = MLP().eval()
data = [torch.randn(8, 16) for _ in range(2)]
tt.wrap(model, ["blocks.0", "blocks.1", "head"], strategy=tt.OneBackendStrategy(CountingBackend()))
tt.tune(model, data, measure=FAST)
tt.save(model, sys.argv[1])
print("saved", flush=True)
original = zipfile.ZipFile.writestr
def slow(self, *args, **kwargs):
    original(self, *args, **kwargs)
    print("midway", flush=True)
    time.sleep(120)
zipfile.ZipFile.writestr = slow
tt.save(model, sys.argv[1])
"""


@pytest.mark.slow
def test_save_killed_midway_keeps_the_earlier_file(tmp_path):
    path = tmp_path / "model.tt"
    env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path)], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=TESTS)
    try:
        assert child.stdout.readline().strip() == "saved"
        before = path.read_bytes()
        assert child.stdout.readline().strip() == "midway"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert path.read_bytes() == before
    fresh = fresh_mlp()
    assert tt.load(fresh, path, backends=[CountingBackend()]) == {"blocks.0": "Counting", "blocks.1": "Counting",
                                                                  "head": "Counting"}


# ------------------------------------------------------------------ bad input


def load_fails(model: nn.Module, path, match: str, **kwargs) -> None:
    kwargs.setdefault("backends", [CountingBackend()])  # the files here name the test's own backend
    before = snapshot(model)
    with pytest.raises(tt.CheckpointError, match=match):
        tt.load(model, path, **kwargs)
    assert_unchanged(model, before)


def test_file_from_another_model(saved):
    _, _, path = saved
    load_fails(nn.Sequential(nn.Linear(16, 4)), path, "another model")
    other = fresh_mlp()
    other.head = nn.Linear(16, 5)
    load_fails(other, path, r"head\.bias is float32\[4\] there, float32\[5\] here")
    retyped = fresh_mlp()
    retyped.head = nn.Sequential()
    load_fails(retyped, path, "another model")


def test_truncated_and_corrupted_files(saved):
    _, _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    load_fails(fresh_mlp(), path, "truncated or damaged")
    path.write_bytes(b"")
    load_fails(fresh_mlp(), path, "not a torch-tweak file")
    start = data.index(b"safetensors") + 200  # a byte inside the stored tensors
    path.write_bytes(data[:start] + bytes([data[start] ^ 0xFF]) + data[start + 1:])
    load_fails(fresh_mlp(), path, "damaged")


def test_member_rewritten_without_its_hash(saved):
    _, _, path = saved
    plan = json.loads(zipfile.ZipFile(path).read("plan.json"))
    plan["depth"] = 0
    rewrite(path, {"plan.json": json.dumps(plan).encode()}, fix_hashes=False)
    load_fails(fresh_mlp(), path, "sha256 of plan.json does not match")


def test_member_added_to_the_file(saved):
    _, _, path = saved
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("extra.bin", b"x")
    load_fails(fresh_mlp(), path, "members are not the ones its manifest lists")


@pytest.mark.slow
def test_file_from_another_device_kind_or_torch_release(saved):
    _, _, path = saved
    rewrite(path, {}, manifest={"device": {"type": "cuda", "name": "NVIDIA H200"}})
    load_fails(fresh_mlp(), path, "tuned on cuda")
    rewrite(path, {}, manifest={"device": {"type": "cpu", "name": "another CPU"}})
    with pytest.warns(UserWarning, match="tuned on another CPU"):
        assert tt.load(fresh_mlp(), path, backends=[CountingBackend()])["head"] == "Counting"
    rewrite(path, {}, manifest={"device": {"type": "cpu", "name": serial.device_name(torch.device("cpu"))},
                                "torch": "1.13.1"})
    load_fails(fresh_mlp(), path, "saved with torch 1.13.1")
    major_minor = ".".join(torch.__version__.split(".")[:2])
    rewrite(path, {}, manifest={"torch": major_minor + ".99"})
    with pytest.warns(UserWarning, match="built again and checked"):
        assert tt.load(fresh_mlp(), path, backends=[CountingBackend()])["head"] == "Counting"


def test_backend_class_named_by_a_file_is_never_built(saved):
    _, _, path = saved
    load_fails(fresh_mlp(), path, "support:CountingBackend is not one of torch-tweak's.*backends=", backends=None)
    plan = json.loads(zipfile.ZipFile(path).read("plan.json"))
    plan["modules"][0]["signatures"][0]["backend"]["class"] = "os:system"
    rewrite(path, {"plan.json": json.dumps(plan).encode()})
    load_fails(fresh_mlp(), path, "os:system is not one of torch-tweak's", backends=[CountingBackend()])


def test_model_already_wrapped(saved):
    model, _, path = saved
    with pytest.raises(ValueError, match="already has torch-tweak wrappers"):
        tt.load(model, path)


def test_pickle_files_execute_nothing(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "model.tt"
    torch.save({"weights": Payload(marker)}, path)  # a .pt file renamed: a zip, with a pickle inside
    load_fails(fresh_mlp(), path, "not a torch-tweak file.*save with tt.save")
    path.write_bytes(pickle.dumps(Payload(marker)))  # a bare pickle
    load_fails(fresh_mlp(), path, "not a torch-tweak file")
    assert not marker.exists()


def test_planted_pickle_in_members_executes_nothing(saved, tmp_path):
    _, data, path = saved
    marker = tmp_path / "marker"
    payload = pickle.dumps(Payload(marker))
    good = path.read_bytes()
    for member in ("plan.json", "samples.safetensors"):
        path.write_bytes(good)
        rewrite(path, {member: payload})
        load_fails(fresh_mlp(), path, "not JSON|not a safetensors file")
    path.write_bytes(good)
    rewrite(path, {"artifacts/inductor.bin": payload})  # artifacts apply only when trusted
    fresh = fresh_mlp()
    assert tt.load(fresh, path, backends=[CountingBackend()])["head"] == "Counting"
    assert not marker.exists()


def test_rebuilt_backend_that_mismatches_runs_the_original(saved):
    model, data, path = saved
    fresh = fresh_mlp()
    with torch.no_grad():
        fresh.head.bias.add_(1.0)  # other weights: the stored outputs no longer match
        expected = fresh(data[0])
    with pytest.warns(UserWarning, match="head .*failed.*run the original forward"):
        chosen = tt.load(fresh, path, backends=[CountingBackend()])
    assert chosen["head"] is None and chosen["blocks.0"] == "Counting"
    with torch.no_grad():
        assert torch.equal(fresh(data[0]), expected)


# ------------------------------------------------------------------ data, never code


@dataclasses.dataclass
class ExtrasConfig(tt.BackendConfig):
    """A custom config with a free-form field (left out of its schema) and a declared one."""

    extras: dict | None = None
    scale: float = 1.0

    SCHEMA = {**tt.BackendConfig.SCHEMA, "scale": Fraction(0.0, 10.0, optional=False)}


class Extras(CountingBackend):
    name = "Extras"
    config_class = ExtrasConfig


def saved_with(tmp_path, backend, **save_args):
    model = fresh_mlp()
    tt.wrap(model, ["blocks.0", "head"], strategy=tt.OneBackendStrategy(backend))
    tt.tune(model, two_shapes(), measure=FAST)
    path = tmp_path / "extras.tt"
    tt.save(model, path, **save_args)
    return model, path


@pytest.mark.slow
def test_free_form_values_are_stored_as_fingerprints_and_given_at_load(tmp_path):
    secret = {"cxx": "some compiler", "flags": ["-O3"]}
    model, path = saved_with(tmp_path, Extras(extras=secret, scale=2.0))
    plan = checkpoint.read_summary(path)["plan"]
    config = plan["modules"][0]["signatures"][0]["backend"]["config"]
    assert config["scale"] == 2.0 and set(config["extras"]) == {"fingerprint"}
    assert "some compiler" not in path.read_bytes().decode("latin-1")  # the value is nowhere in the file
    load_fails(fresh_mlp(), path, "holds only a fingerprint of its extras|is not one of torch-tweak's", backends=None)
    load_fails(fresh_mlp(), path, "another config than the file.s .its extras.",
               backends=[Extras(extras={"cxx": "other"}, scale=2.0)])
    load_fails(fresh_mlp(), path, "another config than the file.s .its scale.", backends=[Extras(extras=secret, scale=3.0)])
    fresh = fresh_mlp()
    assert tt.load(fresh, path, backends=[Extras(extras=dict(secret), scale=2.0)]) == {"blocks.0": "Extras",
                                                                                       "head": "Extras"}
    data = two_shapes()
    with torch.no_grad():
        assert all(torch.equal(fresh(x), model(x)) for x in data)


def test_inductor_options_and_openvino_properties_never_reach_a_file():
    for backend, field in ((tt.backends.TorchInductorBackend(options={"cpp.cxx": ("cc",)}), "options"),
                           (tt.backends.InductorGraphBackend(options={"max_autotune": True}), "options"),
                           (tt.backends.OpenVINOBackend(properties={"CACHE_DIR": "/x"}), "properties")):
        tree = json.loads(serial.dumps(serial.describe_backend(backend)))
        assert set(tree["config"][field]) == {"fingerprint"}
        with pytest.raises(ValueError, match=f"takes no {field} from a file"):
            serial.build_backend(tree)
        assert type(serial.build_backend(tree, [backend])) is type(backend)  # the caller's own, copied
    plain = json.loads(serial.dumps(serial.describe_backend(tt.backends.TorchInductorBackend(mode="max-autotune"))))
    assert serial.build_backend(plain).config.mode == "max-autotune"  # schema values are taken from the file
    combo = json.loads(serial.dumps(serial.describe_backend(tt.backends.InductorGraphBackend(combo_kernels=True))))
    assert serial.build_backend(combo).config.combo_kernels is True  # a closed field: it reaches a file
    combo["config"]["combo_kernels"] = "yes"
    with pytest.raises(ValueError, match="combo_kernels"):
        serial.build_backend(combo)


def test_every_built_in_config_declares_its_schema():
    for cls in tt.backends.BUILT_IN:
        fields = {f.name for f in dataclasses.fields(cls.config_class)}
        free = {"options", "properties"}
        assert set(cls.config_class.SCHEMA) == fields - free, cls  # closed: nothing undeclared but the free-form
        default = json.loads(serial.dumps(serial.describe_backend(cls())))
        assert all(not schema.is_fingerprint(v) for v in default["config"].values()), cls


def test_opt_in_backend_needs_the_callers_consent(tmp_path):
    tree = json.loads(serial.dumps(serial.describe_backend(tt.backends.TorchAOBackend())))
    with pytest.raises(ValueError, match="opt-in"):
        serial.build_backend(tree)
    assert type(serial.build_backend(tree, [tt.backends.TorchAOBackend()])) is tt.backends.TorchAOBackend


def test_tolerance_from_a_file_is_capped_per_dtype():
    ref = torch.ones(4)
    off = ref * 1.2  # 20 % off
    assert correctness.check(off, ref, tolerance=0.5) == pytest.approx(0.2)  # the caller's own wide tolerance
    with pytest.raises(correctness.MismatchError, match="tolerance 0.05"):
        correctness.check(off, ref, tolerance=0.5, bounded=True)  # a file's: at most 0.05 for float32
    assert correctness.tolerance_for(torch.bfloat16, 1.0, bounded=True) == 0.1
    assert correctness.tolerance_for(torch.float32, 1e-4, bounded=True) == 1e-4


@pytest.mark.slow
def test_signed_files(tmp_path):
    key = os.urandom(32)
    model, path = saved_with(tmp_path, Extras(scale=1.0), key=key)
    fresh = fresh_mlp()
    assert tt.load(fresh, path, key=key, backends=[Extras(scale=1.0)])["head"] == "Extras"
    assert tt.load(fresh_mlp(), path, backends=[Extras(scale=1.0)])["head"] == "Extras"  # the key is the loader's choice
    load_fails(fresh_mlp(), path, "not signed with this key", key=b"another key", backends=[Extras(scale=1.0)])
    load_fails(fresh_mlp(), path, "not signed with this key", key=key.hex(), backends=[Extras(scale=1.0)])
    unsigned = tmp_path / "unsigned.tt"
    tt.save(model, unsigned)
    load_fails(fresh_mlp(), unsigned, "is not signed", key=key, backends=[Extras(scale=1.0)])
    rewrite(path, {}, manifest={"created": "2000-01-01"})  # anything changed, even resealed: not the key's seal
    load_fails(fresh_mlp(), path, "is not signed", key=key, backends=[Extras(scale=1.0)])
    for bad in ("", b""):
        with pytest.raises(ValueError, match="key is empty"):
            tt.save(model, path, key=bad)
    with pytest.raises(TypeError, match="key must be bytes or str"):
        tt.load(fresh_mlp(), path, key=123)


def test_file_of_format_1_still_loads(saved, tmp_path):
    model, data, path = saved
    with zipfile.ZipFile(path) as archive:
        files = {n: archive.read(n) for n in archive.namelist()}
    manifest = json.loads(files["manifest.json"])
    manifest["version"] = 1
    files["manifest.json"] = json.dumps(manifest).encode()
    old = tmp_path / "old.tt"
    with zipfile.ZipFile(old, "w") as archive:  # format 1: no seal in the zip comment
        for name, content in files.items():
            archive.writestr(name, content)
    fresh = fresh_mlp()
    assert tt.load(fresh, old, backends=[CountingBackend()])["head"] == "Counting"
    with torch.no_grad():
        assert all(torch.equal(fresh(x), model(x)) for x in data)
    load_fails(fresh_mlp(), old, "is not signed", key=b"k")


def test_model_class_in_the_manifest_is_checked(saved):
    _, _, path = saved

    class Other(MLP):
        pass

    torch.manual_seed(0)
    load_fails(Other().eval(), path, "saved from a support:MLP, this is a .*Other")


def test_save_honours_the_umask(saved, tmp_path):
    model, _, _ = saved
    previous = os.umask(0o022)
    try:
        tt.save(model, tmp_path / "a.tt")
        assert stat.S_IMODE(os.stat(tmp_path / "a.tt").st_mode) == 0o644  # as torch.save and open() give
        os.umask(0o077)
        tt.save(model, tmp_path / "b.tt")
        assert stat.S_IMODE(os.stat(tmp_path / "b.tt").st_mode) == 0o600
        os.chmod(tmp_path / "a.tt", 0o640)
        tt.save(model, tmp_path / "a.tt")  # a file saved again keeps its mode
        assert stat.S_IMODE(os.stat(tmp_path / "a.tt").st_mode) == 0o640
    finally:
        os.umask(previous)


def test_build_log_warning_reaches_the_caller(tmp_path, monkeypatch, mlp_data):
    blocked = tmp_path / "cache"
    blocked.mkdir()
    (blocked / "logs").write_text("a file where the log folder goes")
    monkeypatch.setenv("TORCH_TWEAK_CACHE", str(blocked))
    model = fresh_mlp()
    tt.wrap(model, ["head"], strategy=tt.OneBackendStrategy(CountingBackend()))
    with pytest.warns(UserWarning, match="could not write the build log"):
        tt.tune(model, mlp_data, measure=FAST)
    assert tt.installed(model)["head"].tt_backend.name == "Counting"  # the tuning itself went on


# ------------------------------------------------------------------ one module under two names


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      use_cache=False, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.slow
def test_plan_naming_one_module_twice_is_a_checkpoint_error(tmp_path):
    """LlamaForCausalLM.base_model is a property returning .model: a forged plan that names
    model.layers.0 and base_model.layers.0 (one module object) is refused as a CheckpointError,
    and the model answers exactly as an untuned copy (it was at 6d35efd a ValueError from install)."""
    ids = [torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    tuned = tiny_llama()
    tt.wrap(tuned, ["model.layers.0"], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(tuned, ids, measure=FAST)
    path = tmp_path / "llama.tt"
    tt.save(tuned, path)
    plan = json.loads(zipfile.ZipFile(path).read("plan.json"))
    (entry,) = plan["modules"]
    for alias in (["base_model.layers.0"], ["base_model"], ["base_model.layers.0", "base_model.layers.0.mlp"]):
        forged = dict(plan, modules=[entry] + [dict(entry, path=p) for p in alias])
        if alias == ["base_model"]:  # base_model is .model, which holds model.layers.0
            model_entry = {"path": "base_model", "class": checkpoint.class_path(type(tuned.model)),
                           "params": checkpoint._params(tuned.model), "signatures": []}
            forged["modules"] = [entry, model_entry]
        rewrite(path, {"plan.json": json.dumps(forged).encode()})
        model = tiny_llama()
        load_fails(model, path, "one module object under two names|overlap", backends=None)
        untuned = tiny_llama()
        with torch.no_grad():
            for x in ids:
                assert torch.equal(model(x).logits, untuned(x).logits)


def test_modules_shared_at_two_paths_are_refused_before_anything_changes(tmp_path):
    """Tied embeddings (one nn.Embedding at two attributes) and a property alias: tt.wrap, a
    Plan applied (tuning cache) and tt.load refuse two names of one module, model unchanged."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Embedding(10, 8)
            self.encoder = nn.Sequential(nn.Linear(8, 8))
            self.encoder.embed = self.shared  # as T5/BART tie encoder.embed_tokens and shared
            self.head = nn.Linear(8, 4)

        @property
        def body(self) -> nn.Module:
            return self.encoder

        def forward(self, x):
            return self.head(self.encoder[0](self.shared(x)))

    torch.manual_seed(0)
    model = Tied().eval()
    x = torch.randint(0, 10, (2, 3))
    with torch.no_grad():
        expected = model(x)
    for paths in (["shared", "encoder.embed"], ["encoder", "body.0"], ["body", "encoder.0"]):
        before = snapshot(model)
        with pytest.raises(ValueError, match="one module object under two names|overlap"):
            tt.wrap(model, paths)
        assert_unchanged(model, before)
        plan = planning.Plan(0, [planning.ModulePlan(p, []) for p in paths])
        with pytest.raises(ValueError, match="one module object under two names|overlap"):
            planning.apply(model, plan, device=torch.device("cpu"))
        assert_unchanged(model, before)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


@pytest.mark.slow
def test_a_saved_file_names_no_private_module(tmp_path, mlp_data):
    """A file names torch-tweak's classes by their public paths only (torch_tweak.backends...):
    moving the package's private modules (its folders by layer) never breaks a file written before."""
    model = fresh_mlp()
    tt.wrap(model, ["blocks.0", "head"], strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(model, mlp_data)
    path = tmp_path / "net.tt"
    tt.save(model, path)
    named = []

    def walk(tree):
        if isinstance(tree, dict):
            named.extend(v for k, v in tree.items() if k in ("class", "model") and isinstance(v, str))
            for v in tree.values():
                walk(v)
        elif isinstance(tree, list):
            for v in tree:
                walk(v)

    walk(tt.read_summary(path))
    ours = [name for name in named if name.startswith("torch_tweak")]
    assert ours and all(name.startswith("torch_tweak.backends.") for name in ours), ours
    fresh, untuned = fresh_mlp(), fresh_mlp()
    assert tt.load(fresh, path) == {"blocks.0": "TorchEager", "head": "TorchEager"}
    with torch.no_grad():
        assert all(torch.equal(fresh(x), untuned(x)) for x in mlp_data)


@pytest.mark.parametrize("field, value", [("manifest", {"device": "cuda"}), ("manifest", {"device": [1, 2]}),
                                          ("plan", {"modules": "all"}), ("plan", {"modules": [1, "x", None]}),
                                          ("plan", {"modules": [{"path": 3, "signatures": [7, {"backend": "x"}]}]})])
def test_show_reads_a_forged_field_of_another_type_as_empty(saved, capsys, field, value):
    """`torch-tweak show` on a file whose fields a forger gave another type: it prints what it
    can read, with no traceback; the file still refuses to load."""
    from torch_tweak.cli import main

    model, data, path = saved
    if field == "manifest":
        rewrite(path, {}, manifest=value)
    else:
        with zipfile.ZipFile(path) as archive:
            plan = json.loads(archive.read("plan.json"))
        plan.update(value)
        rewrite(path, {"plan.json": json.dumps(plan).encode()})
    code = main(["show", str(path)])
    out, err = capsys.readouterr()
    if code in (0, 1):  # what it can read, printed (1: with what tt.load refuses)
        assert "file:" in out and "modules:" in out and "Traceback" not in err
    else:  # or refused in one line that says why
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    with pytest.raises(tt.CheckpointError):
        tt.load(fresh_mlp(), path)


def test_a_file_past_what_tt_save_writes_is_refused_for_what_it_is(tmp_path):
    """A file tt.save wrote was refused as "damaged" (test_round_trips.py: it never is now); a
    file past the bounds tt.save writes within (signatures.stored_bounds) is refused by tt.load
    and by `torch-tweak show` alike, saying what is past which bound and how such a file comes
    to be: changed after it was saved, or written by another version, never "damaged" when its
    bytes match their seal."""
    import forgery

    plain, _ = forgery.genuine(tmp_path)
    base = forgery.members(plain)

    def eleven(plan):
        sig = plan["modules"][0]["signatures"][0]
        sig["samples"] = (sig["samples"] * 11)[:11]
        sig["outputs"] = (sig["outputs"] * 11)[:11]

    forged = forgery.with_plan(tmp_path, "eleven", base, eleven)
    model = forgery.build()
    before = snapshot(model)
    with pytest.raises(tt.CheckpointError) as caught:
        tt.load(model, forged)
    assert_unchanged(model, before)
    message = str(caught.value)
    assert "body has 11 stored calls for one signature; tt.save writes at most 10 (8 of the traffic and 2 at " \
           "the declared shapes' ends)" in message
    assert "tt.save does not write that: the file was changed after it was saved" in message
    assert "damaged" not in message
    assert tt.read_summary(forged)["refused"].startswith("body has 11 stored calls")
    assert tt.read_summary(plain)["refused"] is None
    shown = subprocess.run([sys.executable, "-m", "torch_tweak", "show", str(forged)], capture_output=True, text=True,
                           timeout=300)
    assert shown.returncode == 1 and "tt.load:     refuses this file: body has 11 stored calls" in shown.stdout

    newer = forgery.forge(tmp_path, "newer", json_plan(base, eleven), base, manifest={"torch_tweak": "9.0.0"})
    with pytest.raises(tt.CheckpointError, match=r"written by torch-tweak 9\.0\.0, and this is torch-tweak "):
        tt.load(forgery.build(), newer)


def json_plan(base: dict, edit) -> dict:
    plan = json.loads(base["plan.json"])
    edit(plan)
    return {"plan.json": json.dumps(plan).encode()}
