"""Models: loading (model kit, adapters, fused projections), a model's body and head apart, smaller
draft vocabularies, embeddings."""
