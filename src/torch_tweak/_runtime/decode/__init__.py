"""tweak's own decode loop, behind a transformers model's ``generate()`` (docs/generate.md,
"tweak's decode loop", says what it serves and how): the calls people make of a decoder-only
model (greedy or sampling, transformers' common logits processors, left-padded batches) decoded
with transformers' own steps but without its per-token work; the prompt through the model as
``generate()`` calls it; each step's logits from one step source (the model's forward, or the
compiled forward transformers' generate() would use); on CUDA with a static cache, the prefill,
the sampler's draw and (the graph loop) the whole step recorded as device graphs. Any other
call runs transformers' ``generate`` unchanged, its reason logged once and counted
(``DecodeLoop.fallbacks``).

Each part is one object made by its constructor from what it uses (the model, the layouts,
the parts it asks), and keeps its own state; DecodeLoop composes them and has no bases. A
part reads only its own attributes, and another part only through its methods. The package's
modules, from the bottom up: each imports only those listed before it (tests/test_layers.py
checks this list against the files and their imports, and that no part reads another's
attributes).

    call      which generate() calls the loop serves, parsed once (Greedy), and the bounds of
              a stored check call
    model     the model's side: its caches (Caches: transformers' length rule, the caches
              kept per shape), transformers' compile rule and settings, the model as before
              tuning (plain_model), a device graph recorded and replayed (record_graph)
    inputs    a forward call's arguments, positions and attention masks as transformers
              passes them, in the workload's layout (StepInputs)
    prefill   the prompt through the model; on a kept cache, its prefill recorded per prompt
              shape and replayed (Prefills, RecordedPrefill)
    choice    the next token as transformers chooses it: its processors or the top-k sampler,
              the draw, recorded draws, teacher forcing (Choice, TopSampler, RecordedDraw)
    fused_triton  the Triton kernels of tweak's own decode step (the product in its layouts
              and split-K form, the attention per query head); importable without Triton
    fused_tuning  how those kernels' launch settings are chosen on a card (compiled at once,
              timed in CUDA graphs over every layer of a shape)
    fused_kernels  the step's products and attention as torch ops (TorchKernels) or Triton
              kernels (TritonKernels)
    fused_step  tweak's own decode step (FusedDecoder: Llama, Qwen2, Mistral, Qwen3 read as
              shipped; Step: one step's work on a StaticCache of a batch bucket)
    fused_choice  the next token inside that step as fixed work (StepChoice: the processors,
              the repetition penalty from a seen mask, min new tokens from a counter, the draw)
    steps     the steps one by one from a step source (Forward, Compiled, Tuned), and how a
              loop stops: end of sequence, finished rows, CHECK_EVERY, what _C.replay_steps
              is told (Steps, Stopping)
    graph     the graph loop: a decode step recorded as a device graph, replayed per token
              from C (GraphSteps, StepGraph)
    fused_loop  the fused loop: generate() calls decoded by tweak's own step and its choice
              (Fused, its step source; FusedSteps: a call's prefill, its steps in the batch's
              bucket, on CUDA one device graph per shape replayed from C: FusedGraph)
    loop      DecodeLoop, composing the parts; the loops' kinds (KINDS: a step source each);
              the loop's place on a model (install, loop_of)

The package itself exports nothing: import the module that owns a name.
"""
