"""Retrieval: knowledge stored outside the network, as vectors, and looked up per input.

exact       FlatIndex: exact inner-product / L2 search (the oracle; FAISS IndexFlatIP's peer)
kmeans      Lloyd's k-means: IVF's coarse quantizer and PQ's codebooks
pq          ProductQuantizer: M sub-codes of nbits, asymmetric distance tables (Jegou et al. 2011)
ivf         IVFIndex: inverted lists searched nprobe at a time, holding vectors or PQ codes
datastore   byte chunks and their bag-of-words keys (RETRO's chunked set-up)
synthetic   clustered low-rank unit vectors for tests and benchmarks
knn_lm      kNN-LM (Khandelwal et al. 2020): the LM's distribution mixed with its neighbours'
rag         in-context retrieval-augmented LM: chunk neighbours prepended, datastore swapped freely
knowledge   kNN-LM losses beside the datastore's n-gram overlap, search FLOPs, the knowledge update
"""

from .exact import FlatIndex, recall_at_k
from .ivf import IVFIndex
from .kmeans import kmeans
from .pq import ProductQuantizer
from .synthetic import clustered_vectors

__all__ = ["FlatIndex", "IVFIndex", "ProductQuantizer", "kmeans", "recall_at_k", "clustered_vectors"]
