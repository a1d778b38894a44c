#!/bin/bash
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/claims
PYTHONPATH=$PWD timeout 200 python benchmarks/claims.py $R/claims --only resnet50_896 resnet101_896 --steps 4 > $R/claims.log 2>&1
echo "rc $?" >> $R/claims.log
cd benchmarks
PYTHONPATH=$PWD/.. timeout 150 python gpt2_floor.py $R --device cuda > $R/gpt2_floor.log 2>&1
echo "rc $?" >> $R/gpt2_floor.log
cd $OUT && tar czf r.tgz r && rm -rf r
