import sys, torch, transformers, treefx, logging
sys.path.insert(0, 'tests')
backend = sys.argv[1]; budget = int(sys.argv[2]); dev = "cuda"
cfg = transformers.AutoConfig.for_model("qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg).float().to(dev)
import benchmarks.real_trees as rt
trees = [rt.comb_tree(s, 512, calls=6, scale=float(sys.argv[3])) for s in range(2)]
print([t.num_tokens for t in trees])
tm = treefx.compile(model, backend=backend, regional=True, logits=False, verify=False)
loss = treefx.backward(tm, treefx.pack(trees).to(dev), max_tokens=budget)
print('ok', float(loss), treefx.parts.plan(treefx.pack(trees), budget).num_parts)
