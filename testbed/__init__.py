"""The in-box hybrid-cloud testbed: emulated sites and nodes on one Linux machine.

Sites are bridges, nodes are network namespaces, links are shaped with `tc` (htb), and each
node's compute is a CPU quota (cgroup v1 or v2) in proportion to its emulated GPU. See docs/testbed.md.
"""
