"""Samples on disk -> batches: decoding and resizing media (media), finding a sample's elements
(elements), the dataset, buckets and collate (dataset), the cache's files keyed by sample id and
fingerprint (store), and turning raw footage into such samples (prepare/). Imports e2v.runtime and
e2v.config.load."""
