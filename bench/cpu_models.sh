# The cpu benchmarks' model shapes, sourced by torch_compare.sh and transport_compare.sh: model
# flags (dc-plan's names, which torch_peer.py shares) and measured steps per model.
model_flags() {
  case "$1" in
    tiny) echo "--layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 256 --seq 32 --micro-batch 2" ;;
    small) echo "--layers 4 --hidden 256 --heads 8 --kv-heads 4 --ffn 688 --vocab 2048 --seq 128 --micro-batch 4" ;;
    wide) echo "--layers 4 --hidden 512 --heads 8 --kv-heads 4 --ffn 1376 --vocab 4096 --seq 256 --micro-batch 2" ;;
    *) echo "$(basename "$0"): unknown model '$1'; use tiny, small or wide" >&2; exit 2 ;;
  esac
}
steps_for() {
  case "$1" in
    tiny) echo 60 ;;
    small) echo 10 ;;
    *) echo 6 ;;
  esac
}
