"""The fixes: each module or package makes one kind of checkpoint that saves and then fails
(or loads wrong values) impossible, and declares the patches that put it into megatron-core's
own entry points."""
