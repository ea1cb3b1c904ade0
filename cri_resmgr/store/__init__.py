"""Embedded time-series store."""

from .query import Matcher, QueryError, heatmap, parse_matchers, query_range
from .tsdb import Columns, Sample, SeriesRef, Store

__all__ = ["Columns", "Matcher", "QueryError", "Sample", "SeriesRef", "Store", "heatmap", "parse_matchers",
           "query_range"]
