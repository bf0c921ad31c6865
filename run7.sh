sh .whl/install.sh >/dev/null 2>&1; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
rm -rf /tmp/L.ready; touch /tmp/L
T8=threads=128,ctas=8,even=1,groups=2,dec=1,xpair=1,late=1,across=1,w_a=1
OLD=threads=256,ctas=4,groups=2,dec=1,xpair=1,late=1,across=1,w_a=1
sw() { d=$1; shift; PARALLEL=1 LOCK=/tmp/L SWEEP_PROCS=5 DIR=/tmp/$d timeout 200 tools/sweep_w4a16.sh "$@" > $OUT/$d.txt 2>&1; }
sw a 10240x4096,10752x4096,8704x4096 1 "" $T8 $OLD &
sw b 7168x16384 1 "" threads=128,ctas=6,even=1 &
wait
for f in a b; do grep -v "^\s*$" $OUT/$f.txt | grep -v Traceback; done | cut -c1-100
