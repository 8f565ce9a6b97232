"""The benchmarks that run on the testbed through the product: `hybridtrain bench paper`
(`paperbench`, with its workloads, figures and report) and `hybridtrain bench faults`
(`faults`, with its figures and report); both create their runs through the API (`api_runs`)
and read throughput against each node computing alone (`ideal`). The standalone benchmark
scripts sit beside this package in bench/."""
