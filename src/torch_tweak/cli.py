"""The command line: torch-tweak tweak | show.

    torch-tweak tweak examples/Tweak/encoder.py:build --input 8x64x256 --out encoder.tt
    torch-tweak show encoder.tt

Every failure the user can fix (a factory that does not exist, a malformed input
spec, an unknown device, an output path that cannot be written) prints one line
"torch-tweak: error: ..." and exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import re
import sys
from typing import Any, Sequence

from ._core import settings

EXIT_USAGE = 2


class CliError(Exception):
    """A mistake in the command line; its message says what to do."""


DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "double": "float64",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32",
    "bool": "bool",
}

SPEC = re.compile(r"^(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)=)?(?P<shape>\d+(?:x\d+)*)"
                  r"(?::(?P<dtype>[a-z0-9]+))?(?::(?P<high>\d+))?$")


def parse_input(spec: str) -> tuple[str | None, tuple[int, ...], str, int | None]:
    """'[name=]SHAPE[:DTYPE[:HIGH]]' -> (keyword name or None, shape, dtype name or None, high)."""
    match = SPEC.match(spec.strip())
    if match is None:
        raise CliError(f"malformed input spec {spec!r}: write [name=]SHAPE[:DTYPE[:HIGH]], "
                       "e.g. 8x64x256, 8x3x224x224:float16 or input_ids=1x128:int64:30522")
    dtype = match["dtype"]
    if dtype is not None and dtype not in DTYPES:
        raise CliError(f"unknown dtype {dtype!r} in input spec {spec!r}; use one of {', '.join(sorted(DTYPES))}")
    dtype = DTYPES[dtype] if dtype is not None else None
    high = int(match["high"]) if match["high"] else None
    if high is not None and high < 1:
        raise CliError(f"input spec {spec!r}: the upper bound must be at least 1 (values are drawn from 0 to it)")
    if high is not None and dtype not in ("int64", "int32"):
        raise CliError(f"input spec {spec!r}: an upper bound (:{high}) goes only with an integer dtype")
    shape = tuple(int(n) for n in match["shape"].split("x"))
    if 0 in shape:
        raise CliError(f"input spec {spec!r}: every dimension must be at least 1")
    elements = 1
    for n in shape:
        elements *= n
    if elements > settings.CLI_MAX_ELEMENTS:
        raise CliError(f"input spec {spec!r}: {elements:,} elements is more than one input may have here "
                       f"({settings.CLI_MAX_ELEMENTS:,}); give the shape of one real call")
    if high is not None and high >= 2**63:
        raise CliError(f"input spec {spec!r}: the upper bound must be below 2**63")
    return match["name"], shape, dtype, high


def load_factory(target: str):
    """'package.module:function' or 'path/to/file.py:function' -> the callable."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"the model factory {target!r} must be MODULE:FACTORY, e.g. mypkg.models:build "
                       "or path/to/models.py:build")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            if not os.path.isfile(module_name):
                raise CliError(f"the factory file {module_name} does not exist")
            directory = os.path.dirname(os.path.abspath(module_name))
            if directory not in sys.path:
                sys.path.insert(0, directory)  # so the file can import its neighbours
            name = os.path.splitext(os.path.basename(module_name))[0]
            spec = importlib.util.spec_from_file_location(name, module_name)
            if spec is None or spec.loader is None:
                raise CliError(f"the factory file {module_name} is not a Python file: give a .py file")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except CliError:
        raise
    except ModuleNotFoundError as exc:
        raise CliError(f"cannot import {module_name}: {exc}") from None
    except SystemExit as exc:
        raise CliError(f"importing {module_name} exited (sys.exit({exc.code!r})) instead of defining the "
                       "factory") from None
    except Exception as exc:
        raise CliError(f"importing {module_name} failed: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise CliError(f"{module_name} has no function {attr!r}")
    return factory


def check_writable(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory):
        raise CliError(f"cannot write {path}: the folder {directory} does not exist")
    if os.path.isdir(path):
        raise CliError(f"cannot write {path}: it is a folder")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CliError(f"cannot write {path}: permission denied")
    # the file is written beside itself under a longer name first (tt.save): that name must fit too
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        limit = 255
    if len(f".{os.path.basename(path)}.12345678.tmp".encode()) > limit:
        raise CliError(f"cannot write {path}: its file name is too long (at most {limit - 14} bytes here)")


def make_dataset(specs: Sequence[str], count: int, device: Any, seed: int, float_dtype: str = "float32") -> list:
    """`count` calls of random inputs; a spec without a dtype takes `float_dtype`."""
    import torch

    parsed = [parse_input(s) for s in specs]
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        args, kwargs = [], {}
        for name, shape, dtype, high in parsed:
            dtype = dtype or float_dtype
            torch_dtype = getattr(torch, dtype)
            if dtype == "bool":
                value = torch.rand(shape, generator=generator) < 0.5
            elif dtype in ("int64", "int32"):
                value = torch.randint(0, high or 1000, shape, generator=generator, dtype=torch_dtype)
            else:
                value = torch.randn(shape, generator=generator).to(torch_dtype)
            value = value.to(device)
            if name is None:
                args.append(value)
            else:
                kwargs[name] = value
        samples.append((tuple(args), kwargs))
    return samples


def tolerance_arg(text: str) -> str | float:
    """--tolerance as tt.tweak takes it: "measured", "dtype" or a number (checked by tt.tweak)."""
    if text in ("measured", "dtype"):
        return text
    try:
        return float(text)
    except ValueError:
        raise CliError(f"--tolerance {text}: give measured, dtype or a number from 0 to 1") from None


SHAPES_EXAMPLE = "--shapes batch=1:32,length=8:512"


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    """--shapes 'AXIS=MIN:MAX[,AXIS=MIN:MAX]' -> tt.tweak's shapes= ({"batch": (1, 32)}); the
    axes and the ranges' rules are tt.tweak's (checked there)."""
    shapes: dict[str, tuple[int, int]] = {}
    for part in text.split(","):
        match = re.fullmatch(r"\s*([A-Za-z_]+)\s*=\s*(\d+)\s*:\s*(\d+)\s*", part)
        if match is None:
            raise CliError(f"malformed --shapes {text!r}: write AXIS=MIN:MAX, comma-separated, e.g. {SHAPES_EXAMPLE} "
                           "(the axes are batch and length)")
        if match[1] in shapes:
            raise CliError(f"--shapes {text!r} names {match[1]!r} twice")
        shapes[match[1]] = (int(match[2]), int(match[3]))
    return shapes


SETTINGS = {"busy_budget": "--busy-budget", "time_budget": "--time-budget"}
"""tt.tweak's keywords that tweak's own words name (the verdict names the setting that buys
more paired rounds, "busy_budget=300"), and the command's options that set them."""


def in_options(text: str) -> str:
    """tt.tweak's words with each setting they name spelled as this command's option:
    "busy_budget=300 buys them" -> "--busy-budget 300 buys them", "(busy_budget= raises it)" ->
    "(--busy-budget raises it)"."""
    for keyword, option in SETTINGS.items():
        text = re.sub(rf"\b{keyword}=(?=\d)", f"{option} ", text)
        text = re.sub(rf"\b{keyword}=", option, text)
    return text


class InOptions:
    """A text stream that writes tt.tweak's words in this command's options (in_options): its
    progress lines, the last of which says what it kept and which setting buys more rounds."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(in_options(text))

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno...: the stream's own
        return getattr(self.stream, name)


def command_tweak(args: argparse.Namespace) -> int:
    import torch

    import torch_tweak as tt

    if not args.input:
        raise CliError("give at least one --input, e.g. --input 8x64x256")
    for spec in args.input:
        parse_input(spec)
    shapes = parse_shapes(args.shapes) if args.shapes is not None else None
    if args.out:
        check_writable(args.out)
    if args.plot:
        check_writable(args.plot)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        tt.default_backends(device)
        device = torch.device(device)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError("device 'cuda' asked for, but this torch sees no CUDA device")
    factory = load_factory(args.factory)
    try:
        model = factory()
    except SystemExit as exc:
        raise CliError(f"the factory {args.factory} exited (sys.exit({exc.code!r})) instead of returning a "
                       "model") from None
    except Exception as exc:
        raise CliError(f"the factory {args.factory} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise CliError(f"the factory {args.factory} returned a {type(model).__name__}, not a torch.nn.Module")
    model = model.to(device).eval()
    if args.dtype:
        model = model.to(getattr(torch, DTYPES[args.dtype]))
    if not 0 <= args.seed < 2**63:
        raise CliError(f"--seed {args.seed}: give a seed from 0 to 2**63 - 1")
    try:
        dataset = make_dataset(args.input, args.samples, device, args.seed,
                               DTYPES[args.dtype] if args.dtype else "float32")
    except (RuntimeError, MemoryError) as exc:  # inputs too large for the device's memory
        raise CliError(f"cannot make the random inputs {' '.join(args.input)} on {device}: "
                       f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    try:
        depth = {} if args.max_depth is None else {"max_depth": args.max_depth}
        with contextlib.redirect_stderr(InOptions(sys.stderr)):
            result = tt.tweak(model, dataset, min_depth=args.min_depth, time_budget=args.time_budget,
                              progress=not args.quiet, tolerance=tolerance_arg(args.tolerance), shapes=shapes,
                              busy_budget=args.busy_budget, **depth)
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(in_options(str(result)))
    if args.modules:
        print(result.modules)
    if args.plot:
        result.plot(args.plot)
        print(f"chart written to {args.plot}")
    if not result.kept:
        print("nothing kept, nothing saved: the model runs as it did" +
              (f" (no file written to {args.out})" if args.out else ""))
    elif args.out:
        try:
            tt.save(model, args.out)
        except OSError as exc:
            raise CliError(f"the tuning above could not be saved to {args.out}: {exc}") from None
        print(f"tuned model saved to {args.out}; in production: build the model, then tt.load(model, {args.out!r})")
    return 0


def _show_printable(line: str) -> None:
    """A line of `show`: text from the file, printed only printable (no control character of
    a forged file reaches the terminal)."""
    from ._core.storage import printable

    print(printable(line))


def _fields(value: Any) -> dict:
    """A JSON object of a file as show reads it: a forged field of another type reads as empty."""
    return value if isinstance(value, dict) else {}


def _items(value: Any) -> list:
    return value if isinstance(value, list) else []


def command_show(args: argparse.Namespace) -> int:
    if not os.path.lexists(args.file):
        raise CliError(f"{args.file} does not exist")
    from ._store.checkpoint import read_summary
    try:
        summary = read_summary(args.file)
    except (ValueError, OSError) as exc:
        raise CliError(f"{args.file}: {exc}") from None
    manifest, plan = _fields(summary["manifest"]), _fields(summary["plan"])
    show = _show_printable
    device = _fields(manifest.get("device"))
    show(f"file:        {args.file}")
    show(f"model:       {manifest.get('model', '?')}")
    show(f"device:      {device.get('type', '?')}" + (f" ({device['name']})" if device.get("name") else ""))
    show(f"torch:       {manifest.get('torch', '?')}   torch-tweak: {manifest.get('torch_tweak', '?')}")
    show(f"saved:       {manifest.get('created', '?')}")
    depth = plan.get("depth")
    show(f"depth:       {'untuned' if depth is None else depth}")
    modules = [_fields(m) for m in _items(plan.get("modules"))]
    show(f"modules:     {len(modules)}")
    for module in modules:
        signatures = [_fields(s) for s in _items(module.get("signatures"))]
        for i, signature in enumerate(signatures):
            backend = str(_fields(signature.get("backend")).get("name", "original"))
            if signature.get("backend") and not signature.get("samples") and signature.get("key") != "other":
                backend += " (no stored call: runs the original after load)"
            path = str(module.get("path") or "(root)") if i == 0 else ""
            text = str(signature.get("text", "")) if len(signatures) > 1 else ""
            show(f"  {path:<28} {backend:<18} {text}".rstrip())
    if summary["refused"] is not None:  # what tt.load would say, before any model is built
        show(f"tt.load:     refuses this file: {summary['refused']}")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torch-tweak",
        description="Automatic inference tuning for PyTorch: the fastest cut and backend per module.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    tweak = sub.add_parser("tweak", help="tune a model built by a factory function, on random inputs",
                           description="Builds a model by calling FACTORY (no arguments), makes random inputs "
                                       "of the given shapes, runs tt.tweak with its progress line, prints the table "
                                       "and saves the tuned model.")
    tweak.add_argument("factory", metavar="MODULE:FACTORY",
                       help="a function that returns the model: package.module:build or path/file.py:build")
    tweak.add_argument("--input", action="append", metavar="SPEC",
                       help="one argument per --input: [name=]SHAPE[:DTYPE[:HIGH]], e.g. 8x64x256, "
                            "8x3x224x224:float16, input_ids=1x128:int64:30522 (integers drawn in [0, HIGH))")
    tweak.add_argument("--samples", type=int, default=4, help="how many random calls make the dataset (4)")
    tweak.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    tweak.add_argument("--device", help="cpu, cuda, cuda:1, xpu (default: cuda when there is one, else cpu)")
    tweak.add_argument("--dtype", choices=sorted(k for k, v in DTYPES.items() if v.startswith(("float", "bfloat"))),
                       help="cast the model to this dtype first")
    tweak.add_argument("--min-depth", type=int, default=0)
    tweak.add_argument("--max-depth", type=int, help="the deepest cut to try (default: tt.tweak's, 1)")
    tweak.add_argument("--time-budget", type=float, help="seconds; no new depth starts after it")
    tweak.add_argument("--busy-budget", type=float, default=120.0, metavar="SECONDS",  # tt.tweak's busy_budget
                       help="on a busy machine (others taking over a quarter of the CPUs), no new depth starts "
                            "after this many seconds (default 120)")
    tweak.add_argument("--tolerance", default="measured", metavar="RULE",
                       help="how candidates are judged: measured (default: within 4x the original's own error "
                            "against a higher-precision run), dtype (a fixed tolerance per dtype), or a relative "
                            "tolerance from 0 (bit-identical) to 1")
    tweak.add_argument("--shapes", metavar="RANGES",
                       help="the sizes the traffic takes beyond the inputs', as tt.tweak's shapes=: AXIS=MIN:MAX, "
                            "comma-separated, e.g. batch=1:32,length=8:512 (batch: axis 0 of every input; length: "
                            "axis 1 of attention_mask and the inputs shaped like it)")
    tweak.add_argument("--out", metavar="FILE", help="save the tuned model here (e.g. model.tt)")
    tweak.add_argument("--plot", metavar="PNG", help="write a chart of latency per depth")
    tweak.add_argument("--modules", action="store_true", help="also print every module's candidates")
    tweak.add_argument("--quiet", action="store_true", help="no progress display")
    tweak.set_defaults(run=command_tweak)

    show = sub.add_parser("show", help="print what a saved file holds",
                          description="Prints the device, torch version, depth and backend per module of a file "
                                      "written by tt.save or torch-tweak tweak --out.")
    show.add_argument("file", help="a file written by tt.save")
    show.set_defaults(run=command_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "samples", 1) < 1:
        parser.error("--samples must be at least 1")
    try:
        return args.run(args)
    except CliError as exc:  # it may quote a file's text: printable
        from ._core.storage import printable

        print(printable(f"torch-tweak: error: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("torch-tweak: interrupted; the model was left as it was", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
