"""Every numeric knob of torch-tweak, in one place: its value, its unit (the comment on its line)
and why it is what it is (the text under it), grouped by area.

    import torch_tweak as tt
    tt.settings.REFERENCE_SECONDS = 120.0   # seen by the next check that makes a reference

Code reads ``settings.NAME`` where it uses the knob (never ``from settings import NAME``), so a
value set at run time, by a user or a test, is the one the next use sees. docs/settings.md lists
them (tests/test_settings.py checks it against this file, and that no other module of the
package defines a numeric constant but the few format and protocol numbers it names).
"""

import os

import torch

# == The correctness rule ==

TOLERANCES: dict[torch.dtype, float] = {  # relative error
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}
"""The fixed rule's relative tolerance per floating dtype; others (fp8...) use 0.1 (also
``tt.TOLERANCES``, the same dict)."""

MAX_TOLERANCES: dict[torch.dtype, float] = {  # relative error
    torch.float64: 1e-3,
    torch.float32: 0.05,
    torch.float16: 0.05,
    torch.bfloat16: 0.1,
}
"""The most either rule allows per dtype (others: 0.1): neither a tolerance read from a saved
file nor an original whose own error is large widens a check past these."""

MULTIPLIER = 4.0  # times the original's own error
"""The measured rule: a candidate's error against the higher-precision reference may be this
many times the original's own in each group of an output (PyTorch's accuracy harness uses 2 to 3
with one RMS error over a whole output). Measured on transformers and convolution models in
float32 and bfloat16 on a CPU (bench/results/numerics.md): tensor-wide, Inductor's candidates
came to 0.6x to 3.2x the original's own, wrong candidates to 24x to 1e7x; per group, Inductor's
worst group came to 1.1x to 2.2x on BERT, GPT-2, Llama and ViT (at most 0.53 of its bound), and
4.3x on a float32 convolution net whose Inductor convolution is 3x to 4x less accurate than
eager everywhere (kept on the floor of one ulp, at 0.89 of its bound)."""

PEAK_SPREAD = 2.0  # times MULTIPLIER, for a group's largest single error
"""A group's largest single error is held to this many times MULTIPLIER times the original's
largest there (its root mean square to MULTIPLIER alone). The largest of a group's values is the
noisiest of its figures: two right computations of one output, each with errors of the same
size, have largest errors in a group of 64 values that differ by up to about 2x by chance, and a
tensor has hundreds of groups. Measured on the example's encoder in float32 on a CPU: OpenVINO's
build (1.5x faster than eager there) came to 4.9x the original's largest error in its worst
column of 256, at 2x or less in its root mean square. A wrong value is still refused: a value off
by one part in a thousand is thousands of times the original's error in float32."""

MIN_GROUP = 16  # values
"""The fewest values a group of an output holds (rows or columns are gathered up to it): the root
mean square of 16 rounding errors is stable within about 2x from run to run, where one value's is
not."""

MIN_FINITE_SHARE = 0.01  # share of a tensor's values
"""The least share of a floating reference tensor's values that must be finite (and at least
one) for a check against it to accept a backend. Positions where the reference is NaN or Inf
are compared in kind only, so a reference made mostly of them compares almost nothing; a real
module's output with masked positions (-Inf attention scores, causal or padded) keeps far
more than 1 % of its values finite."""

REFERENCE_SECONDS = 60.0  # seconds
"""The most the reference of one module's signature may take (its higher-precision runs):
past it the signature is held to the fixed rule."""

REFERENCE_MEMORY_SHARE = 0.5  # share of the device's free memory
"""The most of the free memory of the module's device (else of the host) the reference's
weights may take."""

TF32_TOLERANCE = 1e-2  # relative error
"""The check's tolerance for a TF32 candidate whose config sets none (a 10-bit mantissa:
about 1e-3 per product, adding up through a block)."""

TORCHAO_TOLERANCE = 0.05  # relative error
"""TorchAO's default relative tolerance (its config's, not the per-dtype defaults): int8
weights alone move a float32 linear layer's outputs by about 0.5 % of their scale, and errors
add up through a block."""

TV_FLOOR = 1e-6  # total variation distance
"""The total variation a sampling call's processed distribution may always differ by: a
softmax's last bit (the same logits through the same processors)."""

# == Recording and declared shapes ==

MAX_SIGNATURES = 4  # signatures
"""Input signatures a module's recording keeps groups for; the calls of any further signature
share one last group, "any other call"."""

MAX_CALLS_PER_SIGNATURE = 8  # calls
"""Recording keeps at most this many of the traffic's calls per signature (merge_varying: per shape class)."""

MAX_DECLARED_CALLS = 2  # calls
"""A shape class's group keeps at most this many calls at the ends of the declared shapes beside
its traffic's (torch_tweak._core.shapes.edge_calls makes one per end; a module called more than
once per model call keeps its smallest and its largest)."""

SHAPE_LIMITS = {"batch": 1 << 16, "length": 1 << 20}  # size along the axis
"""The largest size each axis of tt.tweak's shapes= may declare (what a saved padded config may hold)."""

PARAM_COPY_LIMIT = 256 * 2**20  # bytes
"""Parameters of a module up to this many bytes are copied by a snapshot, so values a
backend wrote in place (even through ``.data``) are put back; larger ones are watched
through their version counter only."""

HEAVY_SHARE = 0.2  # share of the model's time
"""A module is heavy, and gets effort="high"'s variants (channels-last, SDPA kernels,
max-autotune), when its time in the inspected run is at least this share of the whole model's
(the model itself always is). A light module's variant could gain at most its own small share,
and each costs a build (often a compile): the tuning time of effort="high" then grows with the
few heavy modules, not with the model's many small ones."""

DYNAMO_RECOMPILES = {"recompile_limit": 64, "accumulated_recompile_limit": 1024}  # compiles
"""Dynamo's recompile limits during a tweak's own runs, at least (the user's, when higher, stay):
a tweak runs the model on more call shapes than its traffic has (a generate() workload's
prefill, decode steps and checks over the whole sequence; the declared shapes' ends), and a
torch.compile inside the model (transformers' compiled forward) would otherwise meet its
limit of 8, print "torch._dynamo hit config.recompile_limit", and run eagerly from then on."""

# == The machine's load and torch.distributed ==

LOAD_STAT_BYTES = 64 * 1024  # bytes
"""The most bytes of /proc/stat read: its aggregate "cpu" line comes first (a machine of
thousands of CPUs writes its per-CPU lines within this)."""

LOAD_PROCESS_BYTES = 4096  # bytes
"""The most bytes of one /proc/<pid>/stat read (about 300 are written)."""

LOAD_READING_SECONDS = 1.0  # seconds
"""The longest one reading may take (every /proc/<pid>/stat of a machine with thousands of
processes takes a few milliseconds): past it the load is unknown."""

AGREEMENT_TIMEOUTS = 2  # times the group's timeout
"""How many of the group's timeouts (timeout_of) one agreement of the ranks waits, once they
have met."""

# == Isolated builds ==

ISOLATION_CAP = float(os.environ.get("TORCH_TWEAK_ISOLATION_TIMEOUT", "600"))  # seconds
"""The longest an isolated child may run, whatever its expected build time
(``$TORCH_TWEAK_ISOLATION_TIMEOUT``, read at import)."""

ISOLATION_FLOOR = 60.0  # seconds
"""The shortest bound on an isolated child: its start (a spawned one imports torch) on a busy
machine."""

ISOLATION_MULTIPLE = 10.0  # times the expected build time
"""How many times its expected build time an isolated child may take before it counts as hung."""

ISOLATION_DEFAULT_RATE = 5.0  # seconds per unit of size
"""Seconds per unit of a module's size expected when no isolated child of the backend class
finished yet."""

ISOLATION_OUTPUT_TAIL = 4000  # characters
"""Characters of an isolated child's stdout and stderr kept in the build log after a crash."""

VERDICT_MAX_BYTES = 64 * 1024  # bytes
"""A verdict (or the record of children's times) is a few hundred bytes; anything larger is not
one."""

VERDICT_KEPT_TIMES = 16  # children
"""How many finished children's times are kept per backend class and child kind (the
isolation bound reads the largest)."""

# == Serving: traced models, OpenVINO, the padded backend ==

TRACE_MAX_WALK = 200_000  # traced values
"""Traced values one walk visits at most; past it the conversion counts as one of values."""

TRACE_PROVEN_LIMIT = 1 << 16  # call shapes
"""Call shapes a traced model keeps proven at most; past it the proofs start again from the
build's."""

TRACE_REFUSED_LIMIT = 1 << 12  # call shapes
"""Call shapes a traced model keeps refused at most (with why); past it they are checked again at
their next call."""

OV_SEEN_MAX = 4096  # call shapes
"""Call shapes OpenVINO's serving counts at most (those seen once are the many); past it the
counts start again."""

OV_PATIENCE = 5.0  # compiles' time
"""How many compiles' time a shape's calls spend on OpenVINO's dynamic model before it gets its
own: the gain a static model brings is a fraction of each call (5 to 23 % on BERT, 1 % on
ResNet-18, docs/serving.md), so at a fifth of a call a compile is paid back after five compiles'
time of the shape's calls, the break-even of renting against buying. A shape that stops before
that has cost no compile; one that keeps coming gets its model at most that much later."""

OV_IDLE_SECONDS = 10.0  # seconds
"""An OpenVINO compiling thread with nothing to compile for this long ends."""

OV_CACHE_HEADER_BYTES = 4096  # bytes
"""The most bytes of a converted model's header (after its magic line) in torch-tweak's folder
read before its end; a longer one is not an entry."""

OV_CACHE_FOLDER_BYTES = 2 << 30  # bytes
"""The folder of OpenVINO's converted models: its entries past this many bytes are removed, the
least recently used first."""

ORT_MAX_THREADS = 1024  # threads
"""The most intra-op or inter-op threads an ONNX Runtime config may ask (0: ONNX Runtime's
default); a larger count is a mistake, refused with its config (the config's schema, what a saved
file may hold, takes it at import)."""

PADDED_LOAD_GROWTH = 16  # times the longest stored call's length
"""tt.load's bound on a file's padding: a length step (max_length / length_buckets) of at most
this many times the longest stored call's length (padded.load_bound)."""

# == generate(): the workload and a decode loop's check ==

MAX_GENERATE_CALLS = 4  # generate() calls
"""generate() calls of the workload kept to check a decode loop's tokens against."""

TTFT_RUNS = 5  # prefills
"""Timed prefills per measurement of the time to first token (their median is kept)."""

MAX_CHECK_NEW_TOKENS = 256  # tokens
"""The most new tokens a stored generate() call of a decode loop's check may ask for (tt.load
refuses a file that asks more; tt.save stores a longer call with this many)."""

MAX_CHECK_TOKENS = 1 << 16  # tokens
"""The most tokens, batch x (prompt + new tokens), a stored generate() call of a decode loop's
check may decode (tt.load refuses a file that asks more; tt.save leaves such a call out)."""

LOOP_CHECK_SECONDS = 300.0  # seconds
"""The time a loaded decode loop's check may take in all (the untuned generate() runs and the
loop's own): past it the check stops and generate() stays transformers' own."""

SAMPLING_SEED = 0  # torch.manual_seed's seed
"""The seed of the random generators while a sampling generate() call is checked (the untuned
call and the loop's, each in a fork of the generators' state: the caller's state is kept)."""

# == generate(): the decode loop ==

CHECK_EVERY = 16  # decode steps
"""Steps between two reads of the stopping rule (each read waits for the device): a loop's
steps one by one, and the graph loop's replays."""

LOOP_KEPT_KEYS = 64  # prompt shapes
"""The most prompt shapes a decode loop keeps a count or a reason for (the oldest dropped)."""

PREFILL_GRAPHS = 8  # recorded prefills
"""The most recorded prefills a decode loop keeps (the least recently used is dropped)."""

PREFILL_TOKENS = 4096  # tokens, batch x prompt length
"""The most prompt tokens (batch x prompt length) a recorded prefill takes: past them the
device's own time dominates the prefill, and the recording's check holds a copy of the
prompt's part of the cache."""

PREFILL_RECORD_AFTER = 2  # calls of a prompt shape
"""A prompt shape is recorded at its PREFILL_RECORD_AFTER-th call (earlier calls run eagerly): a
stream of prompts whose lengths never repeat does not pay a recording per call."""

SAMPLER_MARGIN = 64  # scores
"""Scores the top-k sampler reads past the k-th for ties with it: more ties than this make a
call run again with transformers' own processors."""

RECORDED_DRAWS = 8  # recorded draws
"""The recorded draws a decode loop keeps (one per batch size, vocabulary and sampler settings);
past it the oldest is dropped."""

# == generate(): the fused step ==

FUSED_BUCKETS = (1, 2, 4, 8)  # batch rows
"""The batch buckets one fused decoder serves: a batch runs in the smallest bucket that holds it."""

FUSED_CACHES = 4  # caches
"""The caches a fused loop keeps (per bucket, length and grad mode; the oldest dropped)."""

FUSED_CHOICES = 16  # choices
"""The choices a fused loop keeps for its steps one by one (per batch, device and settings; the
oldest dropped)."""

FUSED_GRAPHS = 8  # recorded steps
"""The recorded steps a fused loop keeps (per cache, batch and settings; the oldest dropped)."""

FUSED_DYNAMIC_LENGTH = 64  # cache positions
"""A dynamic-cache call's own static cache is a multiple of this many positions (calls of
nearby lengths share one cache, its step and its graph)."""

FUSED_SPLIT_MIN_K = 4096  # a product's inner size
"""The shortest K whose products also get split-K candidates (where few column blocks would read
it: fewer than two a multiprocessor). The H100 probe's down projections (2048 x 8192, 896 x 4864)
are such products (bench/results/decode-step.md)."""

FUSED_SPLIT_MIN_LENGTH = 1024  # cache positions
"""The shortest cache whose attention also gets candidates cut into slices of the positions
(flash-decoding), for enough programs to fill the card."""

FUSED_REPEAT_LAUNCHES = 24  # kernel launches
"""About how many launches one recorded graph of a Triton config's timing holds (the shape's
layers, repeated)."""

# == Files: tt.save / tt.load, the tuning cache ==

LOAD_SLACK_BYTES = 256 << 20  # bytes
"""tt.load reads at most 4 x the model's weights + this from a file unless told (max_bytes)."""

MAX_JSON_BYTES = 16 << 20  # bytes
"""manifest.json and plan.json inflating past this are refused while they are read (a plan
of a hundred modules with eight calls each is well under 1 MiB); so is the header of
samples.safetensors."""

MAX_MANIFEST_VALUES = 4096  # JSON values
"""A manifest holds a few dozen values; more are refused before it is parsed (serial.loads)."""

MAX_DIRECTORY_BYTES = 64 << 10  # bytes
"""A zip directory larger than this is refused from the archive's end record, before it is
read (tt.save's four entries take a few hundred bytes)."""

ARCHIVE_CHUNK_BYTES = 1 << 20  # bytes
"""Bytes read (or inflated) at a time for a member of a saved file that is streamed."""

MAX_JSON_DEPTH = 64  # levels
"""Deeper JSON is refused: nothing torch-tweak writes nests more than a dozen levels."""

MAX_JSON_VALUES = 1 << 20  # JSON values
"""JSON with more values is refused before it is parsed: a parsed value costs 50-250 bytes
(16 MiB of "[]," would build 5.6 million lists, 400 MiB); a plan of a hundred modules with
eight calls each holds a few tens of thousands."""

CACHE_MAX_ENTRY_BYTES = 16 << 20  # bytes
"""A larger tuning-cache entry is not read: a miss."""

CACHE_RETRY_AFTER = 24 * 3600  # seconds
"""Seconds a cached result in which a module or depth failed is reused before tweak tunes
again (a failure may have been the machine's)."""

# == What the user reads ==

ROW_ERROR_BYTES = 500  # bytes
"""A kept result row's error, cut (at a character) below the engine's message size."""

CLI_MAX_ELEMENTS = 2**31  # tensor elements
"""The most elements one random input the command line makes may have (8 GiB of float32)."""
