import sys, os, runpy, torch, fusec
sys.path.insert(0, "benchmarks")
out = os.environ["OUT"]
for num in sys.argv[1:]:
    import glob
    path = glob.glob(f"benchmarks/problems/{num}_*.py")[0]
    mod = runpy.run_path(path)
    torch.manual_seed(0)
    m = mod["get_model"]("gpu").eval().cuda(); inp = [t.cuda() for t in mod["get_inputs"]("gpu")]
    e = fusec.explain(m, *inp)
    open(f"{out}/explain_{num}.txt", "w").write(str(e))
