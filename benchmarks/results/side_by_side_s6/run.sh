set -e
cd /work/main
G=~/.cache/llmserve/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
echo "load before: $(cat /proc/loadavg)"
grep -o -w -E 'avx2|fma|avx512f|avx512bw|avx512_vnni|avx_vnni|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
LD_LIBRARY_PATH=~/.cache/llmserve-anchors/bin ~/.cache/llmserve-anchors/bin/llama-server -m $G -t 2 -np 4 -cb --port 8811 > /tmp/sbs/llama.log 2>&1 &
L=$!
for i in $(seq 100); do curl -sf localhost:8811/health >/dev/null && break; sleep 0.3; done
for c in 1 4; do .venv/bin/llmserve bench serve --base-url http://127.0.0.1:8811 --model smollm2-135m --concurrency $c --num-prompts 16 --input-len 128 --output-len 64 --label llama.cpp --output-json /tmp/sbs/llama_c$c.json 2>&1 | tail -4; done
kill $L; wait $L 2>/dev/null || true
.venv/bin/llmserve serve --port 8812 > /tmp/sbs/llmserve.log 2>&1 &
S=$!
for i in $(seq 100); do curl -sf localhost:8812/health >/dev/null && break; sleep 0.3; done
for c in 1 4; do .venv/bin/llmserve bench serve --base-url http://127.0.0.1:8812 --model smollm2-135m --concurrency $c --num-prompts 16 --input-len 128 --output-len 64 --label llmserve --output-json /tmp/sbs/llmserve_c$c.json 2>&1 | tail -4; done
kill $S; wait $S 2>/dev/null || true
echo "load after: $(cat /proc/loadavg)"
