"""kerninstd, its wire protocol, the live client target and the Linux testbed."""
