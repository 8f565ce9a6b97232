"""The performance model: a plan's step time and hourly cost predicted from profiles, probes and
prices (`predict`, on `inputs` and one step of each strategy in `steps` and `site_replicas`), the
data sets' reads from their stores (`data`), and the placement search over it (`optimize`). Pure
functions, no database; docs/predict.md has the equations."""
