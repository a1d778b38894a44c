export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cd benchmarks
timeout 470 python ratio.py $OUT --models resnet50 densenet121 --dtypes bf16 fp32 --ratios 0.75 0.5 --systems checkpoint superneurons --workers 3 --steps 4 > $OUT/log 2>&1
grep -o '"model": "[a-z0-9_]*", "dtype": "[a-z0-9]*", "system": "[a-z_]*", "ratio": [0-9.nul]*, "control": [a-z]*, "ok": [a-z]*, "[a-z_]*": [0-9.e+]*' $OUT/log
grep -o '"of_plain": [0-9.]*' $OUT/log | head -40
