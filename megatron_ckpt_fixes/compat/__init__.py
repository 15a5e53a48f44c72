"""What the installed megatron-core and torch already have, and CPU/gloo support."""
