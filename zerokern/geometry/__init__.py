"""The geometry of flat buffers, pure math at the bottom of the layers: how params are laid out
in slots, buckets and rank shards (`partition`), and the local view of DTensor params
(`dtensor_params`). Everything that holds memory builds on it (layout/, state/, stage3/)."""
