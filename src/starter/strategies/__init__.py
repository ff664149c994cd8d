"""The modes Lightning lacks (dp, fsdp, tp, pp), each declaring what it supports, and the strategy built from config."""
