#!/usr/bin/env bash
# CLI test of `thinkv calibrate`: a trimodal trace calibrates (JSON + SVG written, the trimodal
# layers chosen); a unimodal trace fails with exit 1 and a message naming the modes found; a
# one-prompt trace fails with exit 1 (fewer than --min-prompts, default 3) unless --min-prompts 1
# is given; a bad flag exits 2.   calibrate_smoke.sh THINKV MAKE_TRACE WORKDIR
set -u
thinkv=$1 make_trace=$2 work=$3
mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $*"; exit 1; }

"$make_trace" tri.csv trimodal 7 || fail "could not write the trimodal trace"
"$make_trace" uni.csv unimodal 7 || fail "could not write the unimodal trace"
rm -f calib.json densities.svg

"$thinkv" calibrate tri.csv -o calib.json --plot densities.svg 2> tri.err
rc=$?
cat tri.err
[ $rc -eq 0 ] || fail "calibrate on a trimodal trace exited $rc"
[ -s calib.json ] || fail "calib.json not written"
grep -q '"format": *"thinkv-calibration"' calib.json || fail "calib.json lacks the format tag"
tr -d ' \n' < calib.json | grep -q '"layers":\[1,3\]' || fail "calib.json did not choose layers 1 and 3: $(cat calib.json)"
grep -q '<svg' densities.svg || fail "densities.svg is not an SVG"

"$thinkv" calibrate uni.csv -o uni.json 2> uni.err
rc=$?
cat uni.err
[ $rc -eq 1 ] || fail "calibrate on a unimodal trace exited $rc, expected 1"
grep -q "mode" uni.err || fail "the unimodal failure does not report the modes found"
[ ! -e uni.json ] || fail "a failed calibration wrote uni.json"

"$make_trace" one.csv trimodal 7 1 || fail "could not write the one-prompt trace"
rm -f one.json one1.json
"$thinkv" calibrate one.csv -o one.json 2> one.err
rc=$?
cat one.err
[ $rc -eq 1 ] || fail "calibrate on a one-prompt trace exited $rc, expected 1"
grep -q "only 1 prompt in the traces; calibration needs at least 3" one.err || fail "the one-prompt failure does not say what was found and needed"
grep -q -- "--min-prompts 1" one.err || fail "the one-prompt failure does not name --min-prompts"
[ ! -e one.json ] || fail "a failed calibration wrote one.json"
"$thinkv" calibrate one.csv -o one1.json --min-prompts 1 2> one1.err
rc=$?
cat one1.err
[ $rc -eq 0 ] || fail "calibrate --min-prompts 1 on a one-prompt trace exited $rc"
tr -d ' \n' < one1.json | grep -q '"prompts":1,' || fail "one1.json does not record 1 prompt: $(cat one1.json)"

"$thinkv" calibrate --no-such-flag tri.csv -o x.json 2> bad.err
rc=$?
[ $rc -eq 2 ] || fail "a bad flag exited $rc, expected 2"
"$thinkv" calibrate --min-prompts 0 tri.csv -o x.json 2> bad.err
rc=$?
[ $rc -eq 2 ] || fail "--min-prompts 0 exited $rc, expected 2"
grep -q -- "--min-prompts 0: must be an integer >= 1" bad.err || fail "--min-prompts 0 message: $(cat bad.err)"
# A tau `thinkv generate` would refuse (not a multiple of the quantization group) is refused here.
"$thinkv" calibrate --tau 24 tri.csv -o tau.json 2> tau.err
rc=$?
[ $rc -eq 2 ] || fail "--tau 24 exited $rc, expected 2"
grep -q "is not a multiple of the quantization group 16" tau.err || fail "--tau 24 message: $(cat tau.err)"
[ ! -e tau.json ] || fail "a refused --tau wrote tau.json"
"$thinkv" calibrate --tau 24 --group 8 tri.csv -o tau8.json 2> tau8.err || fail "--tau 24 --group 8 exited $?: $(cat tau8.err)"
echo "1 passed, 0 failed"
