"""A study for issue 29 (generate() near the memory floor): transformers' compiled decode
step (its compile settings, Inductor's own graphs off) recorded with the argmax in one device
graph by the decode loop kind "compiled-graph", which existed at commit b309569 only; it
runs against that commit. Usage: python bench/studies/compiled_step_study.py 1b compiled-graph.
Prints tokens per second of transformers' static path and of the loop, whether their tokens
are equal, and the recorded step's device time replayed alone."""
import copy, sys, time, torch, transformers
import common
from torch_tweak._runtime import generation
size = sys.argv[1]
prompt, new = 32, 128
if size == "1b":
    model = common.llama_1b(max_positions=8192, generate=True)
else:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval().to("cuda", torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
untuned = copy.deepcopy(model)
ids = torch.randint(100, 500, (1, prompt), device="cuda")
def gen(m):
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=new, do_sample=False, cache_implementation="static")
    torch.cuda.synchronize()
    return out
def timed(label, m, ref=None):
    t = time.perf_counter(); out = gen(m); dt = time.perf_counter() - t
    same = None if ref is None else bool(torch.equal(out, ref))
    print(f"{label}: {dt*1e3:.1f} ms, {new/dt:.0f} tok/s, same={same}", flush=True)
    return out
ref = timed("untuned A", untuned); timed("untuned A2", untuned, ref); timed("untuned A3", untuned, ref)
order = sys.argv[2].split(",")
for kind in order:
    loop = generation.DecodeLoop(model, kind)
    generation.install(model, loop)
    for i in range(3):
        timed(f"{kind} {i}", model, ref)
    generation.uninstall(model)
timed("untuned D", untuned, ref)
if "compiled-graph" in order:
    # the recorded step alone: the device time of one token
    loop = generation.DecodeLoop(model, "compiled-graph"); generation.install(model, loop); gen(model)
    entry = next(iter(loop._graphs.values()))
    torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    entry.cache.reset(); entry.position.fill_(prompt); entry.step.fill_(1)
    s.record()
    for _ in range(100):
        entry.graph.replay()
    e.record(); torch.cuda.synchronize()
    print(f"compiled-graph step replay alone: {s.elapsed_time(e)/100:.3f} ms/token", flush=True)
