"""The user commands, each a thin command line over the e2v package (installed as e2v.tools: the
`e2v-*` console scripts in pyproject.toml). The maintainers' harness is in bench/. Started as a
file from a checkout, each first imports _installed, which says in one line what to install when
the package is not there."""
