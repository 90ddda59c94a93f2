import runpy, sys
import specla_gdn.verify as vk
vk.TUNING["tree"]["prepare"] = "fused"
sys.argv = ["step_anatomy.py"] + sys.argv[1:]
runpy.run_path("benchmarks/scripts/step_anatomy.py", run_name="__main__")
