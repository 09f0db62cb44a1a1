#!/bin/sh
# A rank program that is no Python script (torchrun --no-python env_dump.sh DIR): each rank writes its environment to
# DIR/rank<RANK>.env.
env > "$1/rank$RANK.env"
echo "rank $RANK of $WORLD_SIZE sees CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
