"""Embedded time-series store."""

from .query import Matcher, QueryError, heatmap, parse_matchers, query_range
from .tsdb import Columns, LabelSet, Sample, SeriesRef, Store

__all__ = ["Columns", "LabelSet", "Matcher", "QueryError", "Sample", "SeriesRef", "Store", "heatmap", "parse_matchers",
           "query_range"]
